"""A PD prefill's answer leaves when its export ends, not when the step running beside it ends
(``EngineCore._await_step``, async scheduling). Pure logic: the core's waiting loop with a
stand-in connector and step future; the real path runs in the pd tier."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.request import EngineCoreOutput


class _Worker:
    """The connector's worker side: one export that ends while the step runs."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.finished: dict[str, Any] = {}

    def wake(self) -> None:
        self.event.set()

    def wait_for_event(self, timeout_s: float) -> None:
        if self.event.wait(timeout_s):
            self.event.clear()

    def get_finished_saves(self) -> dict[str, Any]:
        out, self.finished = self.finished, {}
        return out

    def export_ends(self, rid: str) -> None:
        self.finished[rid] = f"params-{rid}"
        self.event.set()


class _Scheduler:
    def __init__(self) -> None:
        self.freed: list[str] = []

    def saves_done(self, done: dict[str, Any], outputs: list[EngineCoreOutput]) -> None:
        for rid, params in done.items():
            self.freed.append(rid)
            o = EngineCoreOutput(rid, [], finish_reason="length")
            o.kv_transfer_params = params
            outputs.append(o)


def _core(worker: _Worker, emitted: list[tuple[str, bool]], step: Future[Any]) -> EngineCore:
    core = object.__new__(EngineCore)
    core.kv_worker = worker  # type: ignore[assignment]
    core.scheduler = _Scheduler()  # type: ignore[assignment]
    core.tracing = None
    core._export_spans = {}
    core.emit = lambda outs: emitted.extend((o.request_id, step.done()) for o in outs)
    return core


def test_an_export_that_ends_mid_step_is_released_before_the_step_ends() -> None:
    worker, step, emitted = _Worker(), Future[Any](), []
    core = _core(worker, emitted, step)

    def device() -> None:
        worker.export_ends("b")  # b's KV reached the sidecar while a's prefill chunk runs
        threading.Timer(0.2, step.set_result, args=({"a": "result"},)).start()

    threading.Thread(target=device).start()
    assert core._await_step(step) == {"a": "result"}
    assert emitted == [("b", False)]  # out before the step ended
    assert core.scheduler.freed == ["b"]  # type: ignore[attr-defined]


def test_without_a_loop_to_send_to_the_outputs_wait_for_the_step() -> None:
    # DP's lockstep drives ``step`` itself: nothing is sent from inside the wait
    worker, step = _Worker(), Future[Any]()
    core = _core(worker, [], step)
    core.emit = None
    worker.export_ends("b")
    step.set_result({})
    assert core._await_step(step) == {}
    assert worker.finished == {"b": "params-b"}  # left for the step's own ``_save_kv``
