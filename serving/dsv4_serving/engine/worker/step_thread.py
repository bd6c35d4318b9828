"""The step thread of async scheduling: runs the steps the core submits, one at a time and in
order, beside the core's own thread (which meanwhile schedules the next step and takes the
outputs of the last one).

The forward runs in the core process, so the overlap needs a second thread: torch releases
the GIL inside its ops (and the EMULATED runner's sleep does too), so the core's Python runs
while the device (or the CPU's other threads) computes. One thread, in submission order, is
what makes async scheduling exact: step N+1's inputs, its state-slot copies, its grammar masks
and its writes into reused blocks all come after step N ended. Before it runs step N+1, the
thread puts the tokens step N sampled where N+1's inputs hold ``PLACEHOLDER``
(``fill_placeholders``), as vLLM's model runner takes them from its previous step's output.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from dsv4_serving.engine.core.sched.async_scheduler import PLACEHOLDER
from dsv4_serving.engine.core.sched.scheduler import RunnerResult, SchedulerOutput

Execute = Callable[[SchedulerOutput], dict[str, RunnerResult]]


def fill_placeholders(out: SchedulerOutput, last: dict[str, int]) -> None:
    """Replace each ``PLACEHOLDER`` input of ``out`` by the token its request sampled in the
    step before (``last``: request id -> that step's last sampled token)."""
    for s in out.scheduled:
        if s.token_ids and s.token_ids[-1] == PLACEHOLDER:
            s.token_ids[-1] = last[s.request_id]


class StepThread:
    def __init__(self, execute: Execute) -> None:
        self._execute = execute
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsv4-step")
        self._last: dict[str, int] = {}  # the previous step's sampled tokens (this thread's)

    def submit(self, out: SchedulerOutput) -> Future[dict[str, RunnerResult]]:
        return self._pool.submit(self._run, out)

    def _run(self, out: SchedulerOutput) -> dict[str, RunnerResult]:
        fill_placeholders(out, self._last)
        results = self._execute(out)
        self._last = {rid: r.token_ids[-1] for rid, r in results.items() if r.token_ids}
        return results

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the step thread after the steps submitted so far; wait for it."""
        self._pool.submit(fn).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
