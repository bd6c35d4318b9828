"""Rank bodies for the shared-memory collectives (module-level, so spawned ranks import them)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from dsv4_serving.distributed import comm
from dsv4_serving.distributed.groups import Group
from dsv4_serving.distributed.parallel_state import destroy_distributed, get_model_parallel
from dsv4_serving.distributed.shm_comm import DISABLE_ENV, SLOT_BYTES
from dsv4_serving.distributed.topology import Topology

from .cases import join


def _against_gloo(g: Group, seed: int) -> dict[str, bool]:
    """The group's shm results vs gloo's on the same data: bitwise, small and in rounds."""
    out = {}
    for name, shape in (("small", (7, 33)), ("rounds", (3, SLOT_BYTES // 4 + 5))):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed + g.index))
        want = x.clone()
        dist.all_reduce(want, group=g.device_group)
        parts = [torch.empty_like(x) for _ in range(g.size)]
        dist.all_gather(parts, x, group=g.device_group)
        out[f"all_reduce_{name}"] = torch.equal(comm.all_reduce(x.clone(), g), want)
        out[f"all_gather_{name}"] = torch.equal(comm.all_gather(x, g, 0), torch.cat(parts, 0))
    return out


def shm_groups(rank: int, world: int, port: int, disable: bool) -> dict[str, Any]:
    if disable:
        os.environ[DISABLE_ENV] = "0"
    topo = Topology(tp=2, dp=world // 2, ep=world)
    join(rank, port, topo, timeout_s=30)
    try:
        m = get_model_parallel()
        groups = {"tp": m.tp, "dp": m.dp, "ep": m.ep}
        res: dict[str, Any] = {k: g.shm is not None for k, g in groups.items() if g.size > 1}
        big = "z" * (3 * SLOT_BYTES) + str(rank)  # an object in several rounds
        res["objects"] = comm.all_gather_object(big, m.tp) == [
            "z" * (3 * SLOT_BYTES) + str(r) for r in m.tp.ranks
        ]
        res["broadcast"] = comm.broadcast_object({"from": rank}, m.tp, src=1)
        if not disable:
            res |= _against_gloo(m.tp, rank)
        return res
    finally:
        destroy_distributed()
