"""Which implementation a collective takes, by backend and device, and what the native
nccl/hccl paths hand the library (no accelerator here: the library call itself is replaced by
one that computes the same result for a simulated peer; the shapes and splits are what is
tested, the dist tier runs the gloo and shared-memory paths for real)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4_serving.distributed import comm
from dsv4_serving.distributed.collective_path import CollectiveError, collective_path
from dsv4_serving.distributed.groups import Group

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("op", "backend", "device", "shm", "path"),
    [
        ("reduce_scatter", "nccl", "cuda", False, "native"),
        ("reduce_scatter", "hccl", "npu", False, "native"),
        ("all_to_all", "nccl", "cuda", False, "native"),
        ("all_to_all", "hccl", "npu", False, "native"),
        # gloo: the all-reduce plus a slice, as before; its own all_to_all_single
        ("reduce_scatter", "gloo", "cpu", False, "emulated"),
        ("all_to_all", "gloo", "cpu", False, "native"),
        # CPU tensors of a node-local group: the shared-memory channel, whatever the backend
        ("reduce_scatter", "gloo", "cpu", True, "shm"),
        ("all_to_all", "gloo", "cpu", True, "shm"),
        # a device tensor never goes through shared memory
        ("reduce_scatter", "nccl", "cuda", True, "native"),
        ("reduce_scatter", "mpi", "cpu", False, "emulated"),
    ],
)
def test_the_path_by_backend_and_device(
    op: Any, backend: str, device: str, shm: bool, path: str
) -> None:
    assert collective_path(op, backend, device, shm) == path


@pytest.mark.parametrize("backend", ["nccl", "hccl"])
def test_a_cpu_tensor_on_a_device_backend_fails_with_a_message(backend: str) -> None:
    with pytest.raises(CollectiveError) as err:
        collective_path("all_to_all", backend, "cpu", False)
    assert str(err.value) == (
        f"all_to_all of a CPU tensor on a {backend} group: {backend} carries device tensors "
        "only; move the tensor to the device (objects and CPU tensors go over the group's "
        "gloo CPU group)"
    )
    g = Group((0, 1), 0, backend=backend)
    with pytest.raises(CollectiveError, match="reduce_scatter of a CPU tensor on a"):
        comm.reduce_scatterv(torch.ones(2, 3), [1, 1], g)  # before any library call


def test_pad_shares_pads_each_share_to_the_longest() -> None:
    x = torch.arange(5.0).unsqueeze(1)  # shares of 2 then 3 rows
    assert comm.pad_shares(x, [2, 3])[:, 0].tolist() == [0.0, 1.0, 0.0, 2.0, 3.0, 4.0]
    same = torch.arange(4.0)
    assert comm.pad_shares(same, [2, 2]).data_ptr() == same.data_ptr()


class _Peer:
    """Stands in for the library's collective on a 2-member group: the other member's input
    is known, so the result is computed as the backend would (recording what it was given)."""

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other
        self.calls: list[dict[str, Any]] = []

    def reduce_scatter_tensor(self, out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
        self.calls.append({"shape": tuple(x.shape), "group": group})
        n = out.shape[0]
        out.copy_((x + self.other)[n * group.index : n * (group.index + 1)])


def test_native_reduce_scatterv_pads_uneven_shares_and_keeps_this_members_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Dev:
        index = 1

    g = Group((0, 1), 1, device_group=Dev(), backend="nccl")
    # 1 row for member 0, 2 for member 1; the peer holds the same layout, padded
    mine = torch.tensor([[1.0], [2.0], [3.0]])
    peer = _Peer(torch.tensor([[10.0], [0.0], [20.0], [30.0]]))
    monkeypatch.setattr(comm, "_reduce_scatter_tensor", peer.reduce_scatter_tensor)
    monkeypatch.setattr(comm, "collective_path", lambda *a: "native")  # "cuda" tensors
    got = comm.reduce_scatterv(mine, [1, 2], g)
    assert peer.calls[0]["shape"] == (4, 1)
    assert got[:, 0].tolist() == [22.0, 33.0]


def test_native_all_to_allv_passes_the_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def all_to_all_single(out: torch.Tensor, x: torch.Tensor, **kw: Any) -> None:
        seen.update(kw, out_rows=out.shape[0], in_rows=x.shape[0])
        out.fill_(7.0)

    g = Group((0, 1), 0, device_group="dev", backend="hccl")
    monkeypatch.setattr(comm, "_all_to_all_single", all_to_all_single)
    monkeypatch.setattr(comm, "collective_path", lambda *a: "native")
    got = comm.all_to_allv(torch.zeros(3, 4), [1, 2], [1, 5], g)
    assert got.shape == (6, 4)
    assert seen == {
        "output_split_sizes": [1, 5],
        "input_split_sizes": [1, 2],
        "group": "dev",
        "out_rows": 6,
        "in_rows": 3,
    }


def test_size_one_groups_call_nothing() -> None:
    x = torch.ones(2)
    assert comm.all_to_allv(x, [2], [2], Group()) is x
    assert comm.reduce_scatterv(x, [2], Group()) is x
