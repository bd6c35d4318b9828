"""The step thread's order: step N's results reach the core only once N+1's inputs are in and
its forward started (nothing of the core's competes with the device's gap), at once when no
step is queued behind N; an error reaches its step's future; ``call`` runs between steps."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from dsv4_serving.engine.core.sched.scheduler import (
    RunnerResult,
    ScheduledRequest,
    SchedulerOutput,
)
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.engine.worker.step_thread import StepThread

pytestmark = pytest.mark.unit


def _out(rid: str) -> SchedulerOutput:
    s = ScheduledRequest(rid, [1], 0, 0, [0], 0, True, None, SamplingParams(), 0)
    return SchedulerOutput([s], [], [], 1)


class Device:
    """Steps that wait for ``go`` after their forward started (as a device step runs)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.go: dict[str, threading.Event] = {}

    def execute(
        self,
        out: SchedulerOutput,
        chain: bool | None,
        prepared: object,
        started: Callable[[], None],
    ) -> dict[str, RunnerResult]:
        rid = out.scheduled[0].request_id
        self.events.append(f"inputs {rid}")
        started()
        self.events.append(f"started {rid}")
        self.go.setdefault(rid, threading.Event()).wait(10)
        if rid == "bad":
            raise RuntimeError("device error")
        return {rid: RunnerResult([len(self.events)])}


def test_results_published_when_the_next_forward_starts() -> None:
    dev = Device()
    steps = StepThread(dev.execute)
    try:
        a = steps.submit(_out("a"))
        b = steps.submit(_out("b"))  # queued behind a
        dev.go.setdefault("a", threading.Event()).set()
        a.result(10)
        # a's results came out after b's inputs were in and its forward started
        assert dev.events[:4] == ["inputs a", "started a", "inputs b", "started b"]
        assert not b.done()
        dev.go.setdefault("b", threading.Event()).set()
        assert b.result(10) == {"b": RunnerResult([4])}  # nothing behind b: at once
        ran: list[str] = []
        steps.call(lambda: ran.append("between"))
        assert ran == ["between"]
    finally:
        steps.close()


def test_a_failed_step_publishes_the_one_before_and_its_error() -> None:
    dev = Device()
    steps = StepThread(dev.execute)
    try:
        a = steps.submit(_out("a"))
        bad = steps.submit(_out("bad"))
        dev.go.setdefault("a", threading.Event()).set()
        dev.go.setdefault("bad", threading.Event()).set()
        assert a.result(10) == {"a": RunnerResult([2])}
        with pytest.raises(RuntimeError, match="device error"):
            bad.result(10)
    finally:
        steps.close()
