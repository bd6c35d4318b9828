"""DP lockstep: one engine core per DP rank, every core one turn per step.

The front end's queues reach the DP-rank-0 core only (the leader). Each turn:
1. the leader drains its queue (blocking up to 0.5 s when the instance is idle: the turn is
   then the heartbeat that keeps every collective far from its timeout), routes each new
   request to a rank (``DPRouter``), sends each abort to the rank that holds the request, and
   broadcasts the per-rank inboxes with the BalanceScheduler freeze over the DP CPU group;
2. every core applies its inbox and steps (``EngineCore.step``: the ranks agree there on a
   forward, a dummy batch on an idle rank, and the MTP chain);
3. the leader gathers each rank's outputs, refusals and stats, hands them to the front end
   and feeds the stats to the router and the next freeze.
No coordinator process: the leader is the one place for DP policy, and the same program runs
over gloo/TCP across nodes.
"""

from __future__ import annotations

import contextlib
import os
import queue
from typing import Any

from dsv4_serving.distributed.comm import broadcast_object, gather_object
from dsv4_serving.distributed.groups import Group
from dsv4_serving.engine.dp.router import Leader, RankReport, StepHeader
from dsv4_serving.engine.engine.core_process import apply_request_message
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.engine.messages import (
    RankMessage,
    Rejected,
    Shutdown,
    ToCore,
)

IDLE_WAIT_S = 0.5


def _drain(in_q: Any, block: bool) -> list[ToCore]:
    msgs: list[ToCore] = []
    if block:
        with contextlib.suppress(queue.Empty):
            msgs.append(in_q.get(timeout=IDLE_WAIT_S))
    while True:
        try:
            msgs.append(in_q.get_nowait())
        except queue.Empty:
            return msgs


def run_lockstep(core: EngineCore, dp: Group, in_q: Any, out_q: Any, parent: int) -> None:
    """The turn loop of one DP rank's core; ``in_q``/``out_q`` are used by the leader only."""
    leader = Leader(dp.size, core.config.max_num_seqs) if dp.index == 0 else None
    stats_due = True
    while True:
        header: StepHeader | None = None
        if leader is not None:
            msgs = _drain(in_q, block=not leader.busy)
            if os.getppid() != parent:
                msgs.append(Shutdown())  # the front end died without telling us
            header, rejected = leader.header(msgs)
            for r in rejected:
                out_q.put(r)
            stats_due = stats_due or bool(msgs)
        header = broadcast_object(header, dp)
        assert header is not None
        if header.stop:
            return
        refused = _apply(core, header.inboxes[dp.index])
        outputs = core.step(admit=not header.freeze)
        report = RankReport(outputs, refused, core.stats(), core.has_unfinished_requests())
        reports = gather_object(report, dp)
        if leader is not None:
            assert reports is not None
            msg = leader.collect(reports)
            for r in (x for rep in reports for x in rep.rejected):
                out_q.put(r)
            if msg.outputs or leader.busy or stats_due:
                out_q.put(msg)
                stats_due = False


def _apply(core: EngineCore, inbox: list[RankMessage]) -> list[Rejected]:
    return [r for msg in inbox if (r := apply_request_message(core, msg)) is not None]
