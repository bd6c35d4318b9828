"""The body of one rank's process in a parallel engine instance (nano-vllm's shape).

Every rank joins the instance's process groups (config fingerprint checked), then builds its
shard of the model and the same-shaped cache (``runner_setup``). TP rank 0 is the engine core:
scheduler, KV cache manager and runner, talking to the front end over its queues as the
single-process core does, and broadcasting each step to its followers: the other ranks of its
step group (TP ranks, and with context parallel every TP rank of every CP rank of its DP rank).
A follower runs exactly that step (``ModelRunner.execute``), so both make the same collectives
in the same order; it stops when told, and fails (exit non-zero) when the core's group breaks.
With DP, the (TP 0, CP 0) rank of every DP rank is a core, and the cores run in lockstep
(``dp/lockstep.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, assert_never

from dsv4_serving.distributed.comm import COMM, broadcast_object
from dsv4_serving.distributed.groups import Group, ModelParallel
from dsv4_serving.distributed.parallel_state import (
    destroy_distributed,
    get_world_group,
    init_distributed,
)
from dsv4_serving.distributed.placement import Placement
from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.dp.lockstep import run_lockstep
from dsv4_serving.engine.engine.core_process import run_engine_core, set_threads
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.engine.messages import CoreFailed
from dsv4_serving.engine.kv_connector.tp_replicate import replicate_kv
from dsv4_serving.engine.worker.model_runner import ModelRunner
from dsv4_serving.engine.worker.runner_setup import setup_runner
from dsv4_serving.engine.worker.step_protocol import Heartbeat, ReplicateKV, RunStep, StopFollowing

log = logging.getLogger(__name__)

# a folder: each rank writes its time in collectives there when it exits (benchmarks)
PROFILE_ENV = "DSV4_COMM_PROFILE"


# each node's own: the URL of its pod's KV sidecar (the same in every pod of a cluster, but not
# when the nodes of an instance share one host)
NODE_LOCAL_FIELDS = frozenset({"kv_sidecar"})


def fingerprint(config: EngineConfig) -> dict[str, Any]:
    """What every rank of an instance must agree on: the whole config but its node-local
    fields."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in NODE_LOCAL_FIELDS}


def rank_main(config: EngineConfig, rank: int, placement: Placement, in_q: Any, out_q: Any) -> None:
    """Rank ``rank`` of the instance (on node ``placement.node_rank``, rendezvous at its
    master address and port); only rank 0 (the core, on node 0) uses the queues."""
    from dsv4_serving.platform.device import detect_platform

    logging.basicConfig(level=os.environ.get("DSV4_LOG_LEVEL", "INFO"))
    topo = config.topology(placement.nnodes)
    set_threads(config, topo.ranks_per_node)  # this node's ranks share its CPUs
    device = detect_platform(None if config.device == "auto" else config.device).name
    try:
        parallel = init_distributed(
            topo,
            rank,
            master_addr=placement.master_addr,
            master_port=placement.master_port,
            device=device,
            timeout_s=config.distributed_timeout,
            rendezvous_timeout_s=config.rendezvous_timeout or None,
            fingerprint=fingerprint(config),
            exact_moe=config.exact_moe,
            eplb=config.enable_eplb,
            redundant_experts=config.eplb_redundant_experts,
        )
    except Exception as exc:
        if rank == 0:
            out_q.put(CoreFailed(f"rank 0: {type(exc).__name__}: {exc}"))
        raise
    world = get_world_group()
    local = topo.local_rank(rank)
    try:
        if topo.tp_rank(rank) == 0 and topo.cp_rank(rank) == 0:
            runner = _core(config, parallel, world, local, in_q, out_q)
        else:
            runner = follow(config, parallel, world, local)
    finally:
        destroy_distributed()
    if PROFILE_ENV in os.environ and runner is not None:
        cp = getattr(runner.forward, "profile", dict)()  # CPForward's counts
        write_comm_profile(Path(os.environ[PROFILE_ENV]), rank, runner.forwards, cp)


def write_comm_profile(
    folder: Path, rank: int, forwards: int, cp: dict[str, float] | None = None
) -> None:
    """This rank's time in collectives, its forward steps and, under CP, those that ran split
    and what their gathers cost (``CPForward.profile``), as ``rank-N.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    body = {
        "rank": rank,
        "comm_s": COMM.seconds,
        "comm_calls": COMM.calls,
        "steps": forwards,
        "cp_split_steps": 0,
        **(cp or {}),
    }
    (folder / f"rank-{rank}.json").write_text(json.dumps(body))


def _core(
    config: EngineConfig,
    parallel: ModelParallel,
    world: Group,
    device_index: int,
    in_q: Any,
    out_q: Any,
) -> ModelRunner | None:
    """TP rank 0 of a DP rank: the engine core. The DP-rank-0 core is the one the front end
    talks to; with DP every core runs the lockstep (``dp/lockstep.py``)."""
    dp = parallel.dp_control

    def build() -> EngineCore:
        return EngineCore(config, parallel, world, device_index)

    def lockstep(core: EngineCore, in_q: Any, out_q: Any, parent: int) -> None:
        run_lockstep(core, dp, in_q, out_q, parent)

    if dp.index == 0:
        core = run_engine_core(config, in_q, out_q, build, lockstep if dp.size > 1 else None)
        return core.runner if core is not None else None
    core = build()
    try:
        lockstep(core, None, None, os.getppid())
    except BaseException:
        core.close(stop_followers=False)
        raise
    core.close()
    return core.runner


def follow(
    config: EngineConfig, parallel: ModelParallel, world: Group, device_index: int
) -> ModelRunner:
    """A follower (TP or CP rank): run each step the core broadcasts, until it says stop."""
    rs = setup_runner(config, parallel, world, device_index, reserve_dummy=parallel.dp.size > 1)
    while True:
        msg = broadcast_object(None, parallel.step)
        match msg:
            case RunStep(out=out, mtp_chain=chain):
                rs.runner.execute(out, chain)
            case ReplicateKV(loads=loads):
                replicate_kv(rs.runner.cache, loads, parallel.step)
            case Heartbeat():
                pass
            case StopFollowing():
                return rs.runner
            case _:
                assert_never(msg)
