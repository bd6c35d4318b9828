"""The step thread of async scheduling: runs the steps the core submits, one at a time and in
order, beside the core's own thread (which meanwhile schedules the next step and takes the
outputs of the last one).

The forward runs in the core process, so the overlap needs a second thread: torch releases
the GIL inside its ops (and the EMULATED runner's sleep does too), so the core's Python runs
while the device (or the CPU's other threads) computes. One thread, in submission order, is
what makes async scheduling exact: step N+1's inputs, its state-slot copies, its grammar masks
and its writes into reused blocks all come after step N ended. Before it runs step N+1, the
thread puts the tokens step N sampled where N+1's inputs hold ``PLACEHOLDER``
(``fill_placeholders``), as vLLM's model runner takes them from its previous step's output;
with MTP also N's new drafts, and N+1's position moved back by the drafts N rejected. The
core has built N+1's input tensors already (``ModelRunner.prepare_ahead``, beside step N):
the thread's share is a few indexed writes of those tokens (and positions) into them.

**The device first.** Between two steps the device waits for this thread alone, so nothing
competes with it there: step N's results go to the core (its future completes) only once
N+1's inputs are in and its forward starts (the runner calls ``started``), or at once when no
step is queued behind N. Completing N's future earlier woke the core into N's outputs (256
requests of Python) while this thread still filled N+1's inputs: every GIL hand-over in
between (each torch op releases it) cost the device time. (The GIL's switch interval stays
Python's 5 ms: a step thread waking from its device step waits for the core's running Python
up to that long, but cut to 0.2 ms it made the emulated step's overrun larger, not smaller,
on a loaded 2-core host: every forced switch waits for the OS to run the other thread.)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsv4_serving.engine.core.sched.async_scheduler import PLACEHOLDER
from dsv4_serving.engine.core.sched.scheduler import RunnerResult, SchedulerOutput

if TYPE_CHECKING:
    from dsv4_serving.engine.worker.model_runner import PreparedStep  # torch: core only

# a step, whether it chains the MTP calls (DP: decided by the ranks together, None: alone),
# its inputs when the core prepared them ahead, and what to call once its forward starts
Execute = Callable[
    [SchedulerOutput, bool | None, "PreparedStep | None", Callable[[], None]],
    dict[str, RunnerResult],
]


def fill_placeholders(
    out: SchedulerOutput, prev: SchedulerOutput | None, results: dict[str, RunnerResult]
) -> None:
    """Fill the inputs of ``out`` that the step before it (``prev``, which gave ``results``)
    produced: a request whose inputs are ``PLACEHOLDER`` was sampled by ``prev`` and scheduled
    at the position it reaches with all of ``prev``'s drafts for it accepted. It gets
    ``prev``'s last sampled token, then ``prev``'s new drafts, and its position goes back by
    the drafts ``prev`` rejected: exactly the synchronous engine's step."""
    before = {s.request_id: s.num_spec for s in prev.scheduled} if prev is not None else {}
    for s in out.scheduled:
        if s.token_ids and s.token_ids[0] == PLACEHOLDER:
            r = results[s.request_id]
            toks = r.token_ids
            assert len(r.draft_ids) >= s.num_spec, (s.request_id, r, s.num_spec)
            s.context_len -= before[s.request_id] - (len(toks) - 1)
            s.token_ids = [toks[-1], *r.draft_ids[: s.num_spec]] if s.num_spec else [toks[-1]]
            s.num_output_tokens += len(toks)
        if s.landing is not None and s.landing[1] is not None and s.context_len == s.landing[0]:
            # it starts at a block boundary: snapshot the state there, before the forward
            out.state_copies.append((s.state_slot, s.landing[1]))


@dataclass(slots=True)
class _Step:
    out: SchedulerOutput
    mtp_chain: bool | None
    prepared: PreparedStep | None
    future: Future[dict[str, RunnerResult]]


@dataclass(slots=True)
class _Call:
    fn: Callable[[], None]
    future: Future[None]


class StepThread:
    def __init__(self, execute: Execute) -> None:
        self._execute = execute
        self._queue: queue.SimpleQueue[_Step | _Call | None] = queue.SimpleQueue()
        # the previous step and its results (this thread's)
        self._prev: SchedulerOutput | None = None
        self._results: dict[str, RunnerResult] = {}
        # the last step's future and results, completed when the next step's forward starts
        self._pending: tuple[Future[dict[str, RunnerResult]], dict[str, RunnerResult]] | None
        self._pending = None
        self._thread = threading.Thread(target=self._loop, name="dsv4-step", daemon=True)
        self._thread.start()

    def submit(
        self,
        out: SchedulerOutput,
        mtp_chain: bool | None = None,
        prepared: PreparedStep | None = None,
    ) -> Future[dict[str, RunnerResult]]:
        future: Future[dict[str, RunnerResult]] = Future()
        self._queue.put(_Step(out, mtp_chain, prepared, future))
        return future

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the step thread after the steps submitted so far; wait for it."""
        future: Future[None] = Future()
        self._queue.put(_Call(fn, future))
        future.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _publish(self) -> None:
        """Step N's results to the core (once N+1's forward started, or nothing follows N)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[0].set_result(pending[1])

    def _loop(self) -> None:
        while True:
            if self._pending is None:
                item = self._queue.get()
            else:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:  # nothing queued behind it: its results go now
                    self._publish()
                    item = self._queue.get()
            if isinstance(item, _Step):
                self._run(item)
                continue
            self._publish()
            if item is None:
                return
            try:
                item.fn()
            except BaseException as e:
                item.future.set_exception(e)
            else:
                item.future.set_result(None)

    def _run(self, step: _Step) -> None:
        try:
            fill_placeholders(step.out, self._prev, self._results)
            results = self._execute(step.out, step.mtp_chain, step.prepared, self._publish)
        except BaseException as e:
            self._publish()
            step.future.set_exception(e)
            return
        self._publish()  # a runner that never called ``started`` (an empty step)
        self._prev, self._results = step.out, results
        self._pending = (step.future, results)
