"""The body of one rank's process in a parallel engine instance (nano-vllm's shape).

Every rank joins the instance's process groups (config fingerprint checked), then builds its
shard of the model and the same-shaped cache (``runner_setup``). TP rank 0 is the engine core:
scheduler, KV cache manager and runner, talking to the front end over its queues as the
single-process core does, and broadcasting each step to its TP followers. A follower runs
exactly that step (``ModelRunner.execute``), so both make the same collectives in the same
order; it stops when told, and fails (exit non-zero) when the core's group breaks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, assert_never

from dsv4_serving.distributed.comm import broadcast_object
from dsv4_serving.distributed.groups import Group, ModelParallel
from dsv4_serving.distributed.parallel_state import (
    destroy_distributed,
    get_world_group,
    init_distributed,
)
from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine_core import EngineCore, run_engine_core
from dsv4_serving.engine.messages import CoreFailed
from dsv4_serving.engine.runner_setup import setup_runner
from dsv4_serving.engine.step_protocol import Heartbeat, RunStep, StopFollowing

log = logging.getLogger(__name__)


def rank_main(config: EngineConfig, rank: int, port: int, in_q: Any, out_q: Any) -> None:
    """Rank ``rank`` of the instance; only rank 0 (the core) uses the queues."""
    import torch

    from dsv4_serving.platform.device import detect_platform

    logging.basicConfig(level=os.environ.get("DSV4_LOG_LEVEL", "INFO"))
    threads = config.rank_threads(os.cpu_count() or 1)
    if threads:
        torch.set_num_threads(threads)
    topo = config.topology()
    device = detect_platform(None if config.device == "auto" else config.device).name
    try:
        parallel = init_distributed(
            topo,
            rank,
            master_addr="127.0.0.1",
            master_port=port,
            device=device,
            timeout_s=config.distributed_timeout,
            fingerprint=dataclasses.asdict(config),
        )
    except Exception as exc:
        if rank == 0:
            out_q.put(CoreFailed(f"rank 0: {type(exc).__name__}: {exc}"))
        raise
    world = get_world_group()
    local = topo.local_rank(rank)
    try:
        if topo.tp_rank(rank) == 0:
            run_engine_core(config, in_q, out_q, lambda: EngineCore(config, parallel, world, local))
        else:
            follow(config, parallel, world, local)
    finally:
        destroy_distributed()


def follow(config: EngineConfig, parallel: ModelParallel, world: Group, device_index: int) -> None:
    """A TP follower: run each step the core broadcasts, until it says stop."""
    rs = setup_runner(config, parallel, world, device_index)
    while True:
        msg = broadcast_object(None, parallel.tp)
        match msg:
            case RunStep(out=out):
                rs.runner.execute(out)
            case Heartbeat():
                pass
            case StopFollowing():
                return
            case _:
                assert_never(msg)
