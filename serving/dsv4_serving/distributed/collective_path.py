"""Which implementation one collective takes, by the group's backend and the tensor's device.

- ``shm``: a CPU tensor on a group whose members share a node (``shm_comm``).
- ``native``: the backend's own collective. nccl and hccl have ``reduce_scatter_tensor`` and an
  uneven ``all_to_all_single``; gloo has ``all_to_all_single`` but no dependable reduce-scatter.
- ``emulated``: what every backend has (a reduce-scatter as an all-reduce plus a slice, an
  all-to-all as an all-gather). Same results, more traffic.

nccl and hccl carry device tensors only: a CPU tensor handed to one of their groups fails here,
naming the backend and the collective, instead of deep inside the library. Pure Python.
"""

from __future__ import annotations

from typing import Literal

Collective = Literal["reduce_scatter", "all_to_all"]
CollectivePath = Literal["shm", "native", "emulated"]

DEVICE_BACKENDS = frozenset({"nccl", "hccl"})
NATIVE: dict[str, frozenset[Collective]] = {
    "nccl": frozenset({"reduce_scatter", "all_to_all"}),
    "hccl": frozenset({"reduce_scatter", "all_to_all"}),
    "gloo": frozenset({"all_to_all"}),
}


class CollectiveError(RuntimeError):
    pass


def collective_path(
    op: Collective, backend: str, device_type: str, has_shm: bool
) -> CollectivePath:
    """The implementation ``op`` takes for a ``device_type`` tensor on a ``backend`` group."""
    if backend in DEVICE_BACKENDS and device_type == "cpu":
        raise CollectiveError(
            f"{op} of a CPU tensor on a {backend} group: {backend} carries device tensors "
            "only; move the tensor to the device (objects and CPU tensors go over the "
            "group's gloo CPU group)"
        )
    if has_shm and device_type == "cpu":
        return "shm"
    if op in NATIVE.get(backend, frozenset()):
        return "native"
    return "emulated"
