"""Collectives over a ``Group``; a size-1 group returns its input untouched (no call made).

A group whose members share a node carries a shared-memory channel (``shm_comm``): CPU tensors
and every object go through it (microseconds instead of gloo's ~0.8 ms per call); device tensors
and groups without one use the torch backend.

gloo (CPU) has no dependable reduce_scatter or uneven all_gather, so there ``reduce_scatterv``
is an all-reduce plus a slice and ``all_gatherv`` pads to the longest share. On nccl/hccl
``reduce_scatterv`` is the native ``reduce_scatter_tensor`` (shares padded to the longest) and
``all_to_allv`` the native ``all_to_all_single``; ``collective_path`` decides which, by backend
and device. The results are the same: each output row is the same sum over the members.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from dsv4_serving.distributed.collective_path import collective_path
from dsv4_serving.distributed.groups import Group
from dsv4_serving.distributed.shm_comm import ShmChannel

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(slots=True)
class CommTime:
    """This process's time inside collectives (the parallel benchmark's communication
    figure; waiting for a slower peer counts too)."""

    seconds: float = 0.0
    calls: int = 0


COMM = CommTime()


def _timed(fn: Callable[P, R]) -> Callable[P, R]:
    @wraps(fn)
    def timed(*args: P.args, **kwargs: P.kwargs) -> R:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            COMM.seconds += time.perf_counter() - t
            COMM.calls += 1

    return timed


_all_reduce = _timed(dist.all_reduce)
_all_gather = _timed(dist.all_gather)
_broadcast = _timed(dist.broadcast)
_broadcast_object_list = _timed(dist.broadcast_object_list)
_gather_object = _timed(dist.gather_object)
_all_gather_object = _timed(dist.all_gather_object)
_reduce_scatter_tensor = _timed(dist.reduce_scatter_tensor)
_all_to_all_single = _timed(dist.all_to_all_single)


def _shm(group: Group, x: torch.Tensor | None = None) -> ShmChannel | None:
    """The group's shared-memory channel when it applies to ``x`` (objects: always)."""
    if group.shm is None or (x is not None and x.device.type != "cpu"):
        return None
    return group.shm  # type: ignore[no-any-return]


@_timed
def _shm_all_reduce(shm: ShmChannel, x: torch.Tensor) -> torch.Tensor:
    return shm.all_reduce(x)


@_timed
def _shm_all_gather(shm: ShmChannel, x: torch.Tensor, dim: int) -> torch.Tensor:
    return shm.all_gather(x, dim)


@_timed
def _shm_broadcast(shm: ShmChannel, x: torch.Tensor, src: int) -> torch.Tensor:
    return shm.broadcast(x, src)


@_timed
def _exchange(group: Group, obj: Any, send: bool) -> list[Any]:
    blobs = group.shm.exchange(pickle.dumps(obj) if send else b"")
    return [pickle.loads(b) if b else None for b in blobs]


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group (in place on ``x``; returns it)."""
    if group.size == 1:
        return x
    if shm := _shm(group, x):
        return _shm_all_reduce(shm, x)
    _all_reduce(x, group=group.device_group)
    return x


def all_gather(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Equal shares concatenated along ``dim`` in group order."""
    if group.size == 1:
        return x
    if shm := _shm(group, x):
        return _shm_all_gather(shm, x, dim)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    _all_gather(parts, x, group=group.device_group)
    return torch.cat(parts, dim=dim)


def all_gather_sizes(n: int, group: Group, device: torch.device) -> list[int]:
    if group.size == 1:
        return [n]
    t = torch.tensor([n], dtype=torch.long, device=device)
    return [int(v) for v in all_gather(t, group, dim=0).tolist()]


def all_gatherv(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    """Uneven shares (``sizes[i]`` rows from member ``i``) concatenated along dim 0."""
    if group.size == 1:
        return x
    longest = max(sizes)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    full = all_gather(padded, group, dim=0)
    return torch.cat([full[i * longest : i * longest + n] for i, n in enumerate(sizes)])


def pad_shares(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``x``'s rows (``sizes[i]`` for member ``i``, concatenated) with every share padded with
    zero rows to the longest: the equal shares a native reduce-scatter takes."""
    longest = max(sizes)
    if all(n == longest for n in sizes):
        return x.contiguous()
    out = x.new_zeros((longest * len(sizes), *x.shape[1:]))
    start = 0
    for i, n in enumerate(sizes):
        out[i * longest : i * longest + n] = x[start : start + n]
        start += n
    return out


def reduce_scatterv(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    """Sum of ``x`` (rows concatenated as ``all_gatherv`` made them) over the group, then this
    member's rows."""
    if group.size == 1:
        return x
    if (
        collective_path("reduce_scatter", group.backend, x.device.type, _shm(group, x) is not None)
        == "native"
    ):
        padded = pad_shares(x, sizes)
        out = padded.new_empty((padded.shape[0] // group.size, *x.shape[1:]))
        _reduce_scatter_tensor(out, padded, group=group.device_group)
        return out[: sizes[group.index]]
    total = all_reduce(x.contiguous(), group)
    start = sum(sizes[: group.index])
    return total[start : start + sizes[group.index]]


def all_to_allv(
    x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group: Group
) -> torch.Tensor:
    """``x``'s rows split ``send_sizes[j]`` to member ``j``, in order; returns the rows every
    member sent this one, ``recv_sizes[j]`` from member ``j``, concatenated in group order
    (what an all-to-all MoE dispatch and its combine need)."""
    if group.size == 1:
        return x
    path = collective_path("all_to_all", group.backend, x.device.type, _shm(group, x) is not None)
    if path == "native":
        out = x.new_empty((sum(recv_sizes), *x.shape[1:]))
        _all_to_all_single(
            out,
            x.contiguous(),
            output_split_sizes=recv_sizes,
            input_split_sizes=send_sizes,
            group=group.device_group,
        )
        return out
    # every member's send sizes, then every member's rows: keep the chunks sent to this one
    every = all_gather_object(list(send_sizes), group)
    full = all_gatherv(x, [sum(s) for s in every], group)
    parts, base, me = [], 0, group.index
    for j, sent in enumerate(every):
        if sent[me] != recv_sizes[j]:
            raise ValueError(
                f"member {j} sends {sent[me]} rows to member {me}, which expects {recv_sizes[j]}"
            )
        start = base + sum(sent[:me])
        parts.append(full[start : start + sent[me]])
        base += sum(sent)
    return torch.cat(parts)


def broadcast(x: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """Member ``src``'s ``x`` on every member, in place (every member passes its tensor of
    that shape and dtype)."""
    if group.size == 1:
        return x
    if shm := _shm(group, x):
        return _shm_broadcast(shm, x, src)
    _broadcast(x, src=group.ranks[src], group=group.device_group)
    return x


def broadcast_object(obj: Any, group: Group, src: int = 0) -> Any:
    """Member ``src``'s object on every member (over the CPU group)."""
    if group.size == 1:
        return obj
    if _shm(group):
        return _exchange(group, obj, group.index == src)[src]
    box = [obj]
    _broadcast_object_list(box, src=group.ranks[src], group=group.cpu_group)
    return box[0]


def gather_object(obj: Any, group: Group, dst: int = 0) -> list[Any] | None:
    """Every member's object, in group order, on member ``dst``; None elsewhere."""
    if group.size == 1:
        return [obj]
    if _shm(group):
        every = _exchange(group, obj, True)
        return every if group.index == dst else None
    out: list[Any] | None = [None] * group.size if group.index == dst else None
    _gather_object(obj, out, dst=group.ranks[dst], group=group.cpu_group)
    return out


def all_gather_object(obj: Any, group: Group) -> list[Any]:
    if group.size == 1:
        return [obj]
    if _shm(group):
        return _exchange(group, obj, True)
    out: list[Any] = [None] * group.size
    _all_gather_object(out, obj, group=group.cpu_group)
    return out
