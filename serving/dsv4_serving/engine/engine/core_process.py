"""The engine-core process: its body (``run_engine_core``: build the core, report ready, loop)
and the loop that takes ``ToCore`` messages and sends ``FromCore`` ones (``_loop``; DP's
lockstep has its own, ``dp/lockstep.py``), and the torch threads a rank runs."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any, assert_never

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    MigrateRequests,
    Outputs,
    RankMessage,
    Ready,
    Rejected,
    Shutdown,
    ToCore,
)

log = logging.getLogger(__name__)


def run_engine_core(
    config: EngineConfig,
    in_q: Any,
    out_q: Any,
    build: Callable[[], EngineCore] | None = None,
    loop: Callable[[EngineCore, Any, Any, int], None] | None = None,
) -> EngineCore | None:
    """Body of the engine-core process: ``ToCore`` messages in, ``FromCore`` messages out.
    ``build`` makes the core (a parallel rank's, with its groups) and ``loop`` steps it (DP's
    lockstep); default: one process."""
    logging.basicConfig(level=os.environ.get("DSV4_LOG_LEVEL", "INFO"))
    if build is None:
        # a parallel rank (``build`` given) has its threads from ``worker.rank_main``, split
        # over its node's ranks; setting them again here would split over the whole world
        set_threads(config)
    parent = os.getppid()
    try:
        core = build() if build is not None else EngineCore(config)
    except Exception as exc:
        out_q.put(CoreFailed(f"{type(exc).__name__}: {exc}"))
        log.debug("engine core failed to start:\n%s", traceback.format_exc())
        return None
    # the startup heap (the model, torch's modules) is never garbage: out of the collector's
    # sight, a full collection scans only what came since (one that scanned it all took ~100
    # ms at 256 sequences, the device idle meanwhile); vLLM's engine core does the same
    gc.collect()
    gc.freeze()
    out_q.put(Ready(core.info))
    try:
        (loop or _loop)(core, in_q, out_q, parent)
    except BaseException:
        core.close(stop_followers=False)  # a broken group: the front end kills the ranks
        raise
    core.close()
    return core


def set_threads(config: EngineConfig, local_ranks: int | None = None) -> None:
    """This rank's torch threads (``core_threads``)."""
    # the CPUs this process may run on (a container's cpuset), not the host's count
    threads = core_threads(config, len(os.sched_getaffinity(0)), local_ranks)
    if threads:
        import torch

        torch.set_num_threads(threads)


def core_threads(config: EngineConfig, cpus: int, local_ranks: int | None = None) -> int:
    """``threads_per_rank``; default: torch's own (0) with one rank, the CPUs split over the
    ranks otherwise, and one when the steps are emulated: the host's side of an
    accelerator's step, torch ops on small CPU tensors, on one thread (vLLM sets
    OMP_NUM_THREADS=1 for GPU workers); a second OpenMP thread would only spin after each of
    them (~1 ms of a core per step at 256 sequences)."""
    if config.emulate_step_time is not None and not config.threads_per_rank:
        return 1
    return config.rank_threads(cpus, local_ranks)


def apply_request_message(core: EngineCore, msg: RankMessage) -> Rejected | None:
    """Add or abort requests on this core; the refusal to send back, if the scheduler refused."""
    match msg:
        case AddRequest(request=req):
            try:
                core.add_request(req)
            except ValueError as exc:  # the scheduler's own refusals (a duplicate id)
                return Rejected(req.request_id, str(exc))
        case AbortRequests(request_ids=ids):
            core.abort_requests(ids)
        case MigrateRequests(request_ids=ids):
            core.migrate(ids)
        case _:
            assert_never(msg)
    return None


def _handle(core: EngineCore, msg: ToCore, out_q: Any) -> bool:
    """Apply one message; False when the core must stop."""
    if isinstance(msg, Shutdown):
        return False
    refused = apply_request_message(core, msg)
    if refused is not None:
        out_q.put(refused)
    return True


def _loop(core: EngineCore, in_q: Any, out_q: Any, parent: int) -> None:
    core.emit = lambda outputs: out_q.put(Outputs(outputs, core.stats()))
    stats_due = True
    published = (-1, -1)  # the (running, waiting) counts the front end last got
    while True:
        msgs: list[ToCore] = []
        if not core.has_unfinished_requests():
            with contextlib.suppress(queue.Empty):  # idle: block briefly, do not spin
                msgs.append(in_q.get(timeout=0.5))
        while True:
            try:
                msgs.append(in_q.get_nowait())
            except queue.Empty:
                break
        for msg in msgs:
            if not _handle(core, msg, out_q):
                return
            stats_due = True
        if core.has_unfinished_requests():
            t = time.perf_counter()
            outputs = core.step()
            log.debug("step %.1f ms, %d outputs", 1e3 * (time.perf_counter() - t), len(outputs))
            if core.idle_waiting_for_kv and not stats_due:
                core.wait_for_kv(0.02)  # only parked requests: no busy loop, no message flood
                continue
            stats = core.stats()
            out_q.put(Outputs(outputs, stats))
            stats_due, published = False, (stats.num_running, stats.num_waiting)
        else:
            core.kv_housekeeping()
            core.heartbeat()
            # idle, a count may still change (a moved request's export ended): the gauges a
            # drain polls must not stay stale
            if stats_due or core.scheduler.load() != published:
                stats = core.stats()
                out_q.put(Outputs([], stats))
                stats_due, published = False, (stats.num_running, stats.num_waiting)
            elif os.getppid() != parent:
                return  # the front end died without telling us
