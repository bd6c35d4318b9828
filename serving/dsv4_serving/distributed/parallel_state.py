"""Process groups of one engine instance: rendezvous, the groups of a ``Topology``, a config
fingerprint check, getters and teardown.

Every group gets a device group (the platform's backend: gloo on CPU, nccl, hccl) and a gloo
CPU group for objects and barriers (the same group when the backend is gloo). Rendezvous runs
on our own TCPStore first so a missing rank is named ("ranks 2, 3 (node 1) never joined")
instead of surfacing as torch's generic store timeout.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from dsv4_serving.distributed.comm import all_gather_object
from dsv4_serving.distributed.groups import Group, ModelParallel
from dsv4_serving.distributed.shm_comm import open_channel
from dsv4_serving.distributed.topology import Topology
from dsv4_serving.platform.device import get_platform


class RendezvousError(RuntimeError):
    pass


class FingerprintError(RuntimeError):
    pass


_STATE: dict[str, Any] = {}


SHAPE_KEY = "dsv4/shape"
MISMATCH_KEY = "dsv4/mismatch"


def describe(topo: Topology) -> str:
    return f"world {topo.world} ({topo.shape} over {topo.nnodes} node(s))"


def _check_shape(store: Store, topo: Topology, rank: int, where: str) -> None:
    """Rank 0 publishes its world's shape; any other rank with another shape (a node started
    with other sizes) fails, and posts why so that the ranks already waiting fail with it
    instead of waiting out the timeout for ranks that will never come."""
    mine = describe(topo)
    if rank == 0:
        store.set(SHAPE_KEY, mine)
        return
    master = store.get(SHAPE_KEY).decode()
    if master != mine:
        msg = (
            f"world size mismatch at the rendezvous {where}: rank {rank} (node "
            f"{topo.node_of(rank)}) runs {mine} but rank 0 runs {master}; every node of an "
            "instance needs the same --tensor-parallel-size, --context-parallel-size, "
            "--data-parallel-size and --nnodes"
        )
        store.set(MISMATCH_KEY, msg)
        raise RendezvousError(msg)


def _join(topo: Topology, rank: int, addr: str, port: int, timeout_s: float) -> Store:
    where = f"tcp://{addr}:{port}"
    try:
        store = TCPStore(
            addr,
            port,
            topo.world,
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError variants
        raise RendezvousError(
            f"rank {rank} could not reach the rendezvous master at {where} within "
            f"{timeout_s:g} s (is node 0 / rank 0 started, and is the address right?): {exc}"
        ) from exc
    _check_shape(store, topo, rank, where)
    store.set(f"dsv4/joined/{rank}", str(topo.node_of(rank)))
    keys = [f"dsv4/joined/{r}" for r in range(topo.world)]
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([MISMATCH_KEY]):  # another node runs another shape: it said which
            raise RendezvousError(store.get(MISMATCH_KEY).decode())
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            return store
        if time.monotonic() > deadline:
            nodes = sorted({topo.node_of(r) for r in missing})
            raise RendezvousError(
                f"rendezvous at {where} timed out after {timeout_s:g} s: ranks "
                f"{', '.join(map(str, missing))} (node {', '.join(map(str, nodes))}) of "
                f"world {topo.world} ({topo.shape} over {topo.nnodes} nodes) "
                "never joined"
            )
        time.sleep(0.05)


def _group(ranks: list[int], rank: int, backend: str, timeout: timedelta) -> Group:
    # every rank creates every group, in the same order (torch's rule), members or not
    if len(ranks) == 1:
        return Group((ranks[0],), 0)
    dev = dist.new_group(ranks, timeout=timeout, backend=backend)
    cpu = dev if backend == "gloo" else dist.new_group(ranks, timeout=timeout, backend="gloo")
    if rank not in ranks:
        return Group(tuple(ranks), -1)
    return Group(tuple(ranks), ranks.index(rank), dev, cpu, backend=backend)


def _with_shm(group: Group, topo: Topology, timeout_s: float) -> Group:
    """``group`` with a shared-memory channel when its members share a node (every member
    calls this for its groups in the same order)."""
    if group.size == 1 or len({topo.node_of(r) for r in group.ranks}) > 1:
        return group
    return replace(group, shm=open_channel(group.ranks, group.index, group.cpu_group, timeout_s))


def _mine(groups: list[Group]) -> Group:
    return next(g for g in groups if g.index >= 0)


def check_fingerprint(fingerprint: dict[str, Any], world: Group) -> None:
    """Every rank must run with rank 0's settings; the first that differs is named."""
    every = all_gather_object(fingerprint, world)
    for r, fp in enumerate(every):
        if fp != every[0]:
            diff = sorted(k for k in set(fp) | set(every[0]) if fp.get(k) != every[0].get(k))
            detail = ", ".join(f"{k}: {every[0].get(k)!r} vs {fp.get(k)!r}" for k in diff)
            raise FingerprintError(f"rank {r} disagrees with rank 0 on {detail}")


def init_distributed(
    topo: Topology,
    rank: int,
    *,
    master_addr: str,
    master_port: int,
    device: str = "cpu",
    timeout_s: float = 60.0,
    rendezvous_timeout_s: float | None = None,
    fingerprint: dict[str, Any] | None = None,
    exact_moe: bool = False,
    eplb: bool = False,
    redundant_experts: int = 0,
) -> ModelParallel:
    """Join the instance's world as ``rank`` and build its groups over ``device``'s
    collective backend (a missing accelerator fails here, before any rendezvous); returns the
    groups a model is built with. The ranks wait ``rendezvous_timeout_s`` (default
    ``timeout_s``) for each other, then ``timeout_s`` in any collective."""
    if _STATE:
        raise RuntimeError("distributed state is already initialised; destroy it first")
    platform = get_platform(device)
    platform.set_device(topo.local_rank(rank))
    backend = platform.dist_backend
    store = _join(topo, rank, master_addr, master_port, rendezvous_timeout_s or timeout_s)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend,
        store=PrefixStore("dsv4/pg", store),
        rank=rank,
        world_size=topo.world,
        timeout=timeout,
    )
    world = Group(tuple(range(topo.world)), rank, dist.group.WORLD, None, backend=backend)
    cpu_world = world.device_group
    if backend != "gloo":
        cpu_world = dist.new_group(list(range(topo.world)), timeout=timeout, backend="gloo")
    world = replace(world, cpu_group=cpu_world)
    tp = _mine([_group(g, rank, backend, timeout) for g in topo.tp_groups()])
    dp = _mine([_group(g, rank, backend, timeout) for g in topo.dp_groups()])
    world, tp, dp = (_with_shm(g, topo, timeout_s) for g in (world, tp, dp))
    cp, step = Group((rank,), 0), tp
    if topo.cp > 1:  # created after the others: a cp-1 world builds the groups it always did
        cp = _mine([_group(g, rank, backend, timeout) for g in topo.cp_groups()])
        step = _mine([_group(g, rank, backend, timeout) for g in topo.step_groups()])
        cp, step = (_with_shm(g, topo, timeout_s) for g in (cp, step))
    ep = world if topo.ep > 1 else Group((rank,), 0)
    dp_control = dp
    if topo.dp > 1:  # created last: the groups before keep their order; CPU objects only
        dp_control = _mine([_group(g, rank, "gloo", timeout) for g in topo.dp_groups()])
        dp_control = _with_shm(dp_control, topo, timeout_s)
    if topo.world == 1:
        world = Group()
    _STATE.update(topology=topo, rank=rank, world=world, store=store)
    _STATE["model"] = ModelParallel(
        tp=tp,
        dp=dp,
        ep=ep,
        cp=cp,
        step=step,
        dp_control=dp_control,
        exact_moe=exact_moe,
        eplb=eplb,
        redundant_experts=redundant_experts,
    )
    if fingerprint is not None:
        try:
            check_fingerprint(fingerprint, world)
        except FingerprintError:
            destroy_distributed()
            raise
    return _STATE["model"]  # type: ignore[no-any-return]


def _get(key: str) -> Any:
    if key not in _STATE:
        raise RuntimeError("distributed state is not initialised (call init_distributed)")
    return _STATE[key]


def get_topology() -> Topology:
    return _get("topology")  # type: ignore[no-any-return]


def get_rank() -> int:
    return _get("rank")  # type: ignore[no-any-return]


def get_world_group() -> Group:
    return _get("world")  # type: ignore[no-any-return]


def get_model_parallel() -> ModelParallel:
    return _get("model")  # type: ignore[no-any-return]


def get_tp_group() -> Group:
    return get_model_parallel().tp


def get_dp_group() -> Group:
    return get_model_parallel().dp


def get_ep_group() -> Group:
    return get_model_parallel().ep


def get_cp_group() -> Group:
    return get_model_parallel().cp


def destroy_distributed() -> None:
    if "model" in _STATE:
        m: ModelParallel = _STATE["model"]
        groups = (_STATE["world"], m.tp, m.dp, m.ep, m.cp, m.step)
        for g in {id(g): g for g in groups}.values():
            if g.shm is not None:
                g.shm.close()
    if _STATE and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.clear()
