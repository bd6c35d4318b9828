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
with MTP also N's new drafts, and N+1's position moved back by the drafts N rejected.
Without MTP the core has built N+1's input tensors already (``ModelRunner.prepare_ahead``,
beside step N): the thread's share is one indexed write of those tokens into them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from dsv4_serving.engine.core.sched.async_scheduler import PLACEHOLDER
from dsv4_serving.engine.core.sched.scheduler import RunnerResult, SchedulerOutput

if TYPE_CHECKING:
    from dsv4_serving.engine.worker.model_runner import PreparedStep  # torch: core only

# a step, whether it chains the MTP calls (DP: decided by the ranks together, None: alone) and
# its inputs when the core prepared them ahead
Execute = Callable[[SchedulerOutput, bool | None, "PreparedStep | None"], dict[str, RunnerResult]]


def fill_placeholders(
    out: SchedulerOutput, prev: SchedulerOutput | None, results: dict[str, RunnerResult]
) -> None:
    """Fill the inputs of ``out`` that the step before it (``prev``, which gave ``results``)
    produced: a request whose inputs are ``PLACEHOLDER`` was sampled by ``prev`` and scheduled
    at the position it reaches with all of ``prev``'s drafts for it accepted. It gets
    ``prev``'s last sampled token, then ``prev``'s new drafts, and its position goes back by
    the drafts ``prev`` rejected: exactly the synchronous engine's step."""
    before = {s.request_id: s for s in prev.scheduled} if prev is not None else {}
    for s in out.scheduled:
        if s.token_ids and s.token_ids[0] == PLACEHOLDER:
            p, r = before[s.request_id], results[s.request_id]
            assert len(r.draft_ids) >= s.num_spec, (s.request_id, r, s.num_spec)
            s.context_len -= p.num_spec - (len(r.token_ids) - 1)
            s.token_ids = [r.token_ids[-1], *r.draft_ids[: s.num_spec]]
            s.num_output_tokens += len(r.token_ids)
        if s.landing is not None and s.landing[1] is not None and s.context_len == s.landing[0]:
            # it starts at a block boundary: snapshot the state there, before the forward
            out.state_copies.append((s.state_slot, s.landing[1]))


class StepThread:
    def __init__(self, execute: Execute) -> None:
        self._execute = execute
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsv4-step")
        # the previous step and its results (this thread's)
        self._prev: SchedulerOutput | None = None
        self._results: dict[str, RunnerResult] = {}

    def submit(
        self,
        out: SchedulerOutput,
        mtp_chain: bool | None = None,
        prepared: PreparedStep | None = None,
    ) -> Future[dict[str, RunnerResult]]:
        return self._pool.submit(self._run, out, mtp_chain, prepared)

    def _run(
        self, out: SchedulerOutput, mtp_chain: bool | None, prepared: PreparedStep | None
    ) -> dict[str, RunnerResult]:
        fill_placeholders(out, self._prev, self._results)
        results = self._execute(out, mtp_chain, prepared)
        self._prev, self._results = out, results
        return results

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the step thread after the steps submitted so far; wait for it."""
        self._pool.submit(fn).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
