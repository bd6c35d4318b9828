"""EMULATED engine steps (``--emulate-step-time``): capacity tests of the autoscaler on CPUs that
cannot add real capacity, the way llm-d tests with its inference simulator.

The emulated runner replaces only the forward: each step sleeps for a time that is a function
of its batch (``StepTime``) and every sampled position gets a deterministic token. Everything
else stays real: the runner's input preparation (token ids, attention metadata, block tables:
host work a real device step has too, timed as ``prepare_s``), the scheduler and its batching, the paged KV blocks and their cache tensors
(so a prefill engine exports, and a decode engine imports, real bytes over the real sidecars),
the metrics, the HTTP front end and the PD protocol. Sleeping costs no CPU, so several emulated
engines on two cores give several engines' worth of capacity.

The token at position ``p`` after token ``t`` is ``emulated_token(p, t)``: it depends on the
position and the previous token only, so a decode engine continuing a remote prefill produces
exactly the tokens a single engine would, and MTP drafts (the next tokens of the same chain)
are always accepted. Sampling parameters (temperature, seed) are ignored; logprobs are 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dsv4_serving.engine.emulated.step_time import StepTime
from dsv4_serving.engine.request import Logprob

if TYPE_CHECKING:
    from dsv4_serving.engine.core.sched.scheduler import RunnerResult, SchedulerOutput
    from dsv4_serving.engine.worker.model_runner import ModelRunner, PreparedStep

log = logging.getLogger(__name__)

EMULATED_METRIC = "dsv4_engine_emulated_step_time"
_FIRST = 100  # emulated tokens avoid the low ids (special tokens of most vocabularies)


def emulated_token(position: int, previous: int, vocab_size: int, eos: int | None) -> int:
    """The token at ``position`` after ``previous``: never ``eos`` nor a low (special) id."""
    span = vocab_size - _FIRST
    t = _FIRST + (previous * 1_000_003 + position * 7_919) % span
    return _FIRST + (t - _FIRST + 1) % span if t == eos else t


class EmulatedRunner:
    """``ModelRunner``'s interface over a real runner (its cache, dummy batch) whose forward is
    never run: ``execute`` sleeps ``StepTime`` and returns deterministic tokens."""

    def __init__(
        self,
        real: ModelRunner,
        step_time: StepTime,
        sleep: Any = time.sleep,
        clock: Any = time.perf_counter,
    ) -> None:
        self.real = real
        self.step_time = step_time
        self.lm = real.lm
        self.cache = real.cache
        self.dummy = real.dummy
        self.samples = real.samples
        self.k = real.k
        self.forwards = 0
        self.prepare_s = 0.0
        self._sleep = sleep
        self._clock = clock
        cfg = real.lm.model_config
        self.vocab_size = int(cfg.vocab_size)
        eos = cfg.eos_token_id
        self.eos: int | None = eos[0] if isinstance(eos, list) else eos
        log.warning(
            "EMULATED engine: steps sleep %s ms (base, per sequence, per token) instead of "
            "running the model; tokens are synthetic",
            step_time,
        )

    def __getattr__(self, name: str) -> Any:
        # anything else the engine asks of its runner is the real runner's (cache, EPLB, ...)
        return getattr(self.real, name)

    def dummy_step(self) -> SchedulerOutput:
        return self.real.dummy_step()

    def next_token(self, position: int, previous: int) -> int:
        return emulated_token(position, previous, self.vocab_size, self.eos)

    def prepare_ahead(self, out: SchedulerOutput) -> PreparedStep | None:
        return self.real.prepare_ahead(out)

    def execute(
        self,
        out: SchedulerOutput,
        mtp_chain: bool | None = None,
        prepared: PreparedStep | None = None,
        started: Callable[[], None] | None = None,
    ) -> dict[str, RunnerResult]:
        del mtp_chain  # no MoE calls to keep in step with other DP ranks
        if not out.scheduled:
            return {}
        self.forwards += 1
        # the real preparation, or the fill of the one the core made ahead (async scheduling)
        self.real.inputs(out.scheduled, prepared)
        # the device starts now and ends ``StepTime`` later, whatever the host does meanwhile:
        # handing the previous step's results over (``started``) and computing this step's
        # tokens (a real device samples, and the host copies the tokens back once) are inside
        # the step's window, as they are beside a real device's step
        deadline = self._clock() + self.step_time.seconds(
            len(out.scheduled), out.num_batched_tokens
        )
        self.prepare_s = self.real.prepare_s
        if started is not None:
            started()
        results = self._sample(out)
        self._sleep_until(deadline)
        return results

    def _sleep_until(self, deadline: float) -> None:
        """Sleep to the step's absolute end, never before it: the device is never early. A
        sleep returns late by the timer's slack and the wait for the GIL; that lateness is
        the host's share of the gap between two steps, as a late wake-up from a device sync
        is, so nothing makes up for it (and nothing spins: the host's work needs the core)."""
        left = deadline - self._clock()
        while left > 0:
            self._sleep(left)
            left = deadline - self._clock()

    def _sample(self, out: SchedulerOutput) -> dict[str, RunnerResult]:
        """Every sampling request's verified tokens and next drafts: ``emulated_token``'s
        chain, its arithmetic inlined (256 requests with MTP 3 make ~1,800 tokens a step:
        as calls they took ~1 ms of the step thread's GIL beside the core's work)."""
        from dsv4_serving.engine.core.sched.scheduler import RunnerResult

        results: dict[str, RunnerResult] = {}
        if not self.samples:
            return results
        first, span, eos, k = _FIRST, self.vocab_size - _FIRST, self.eos, self.k
        for s in out.scheduled:
            if not s.sample:
                continue
            # verify the drafts against the chain, as the sampler does against the logits
            ids, n = s.token_ids, len(s.token_ids)
            j = n - s.num_spec - 1
            prev, pos = ids[j], s.context_len + 1 + j
            toks: list[int] = []
            drafts: list[int] = []
            verifying = True  # then the k next drafts, from the last verified token on
            while verifying or len(drafts) < k:
                t = first + (prev * 1_000_003 + pos * 7_919) % span
                if t == eos:
                    t = first + (t - first + 1) % span
                if verifying:
                    toks.append(t)
                    j += 1
                    verifying = j < n and ids[j] == t
                else:
                    drafts.append(t)
                prev, pos = t, pos + 1
            lp = None
            if s.sampling_params.logprobs is not None:
                lp = [Logprob(x, 0.0, [(x, 0.0)]) for x in toks]
            results[s.request_id] = RunnerResult(toks, lp, drafts)
        return results


def register_metric(registry: Any, step_time: StepTime) -> None:
    """``dsv4_engine_emulated_step_time{base_ms,per_seq_ms,per_token_ms} 1`` on the engine's
    /metrics, so no dashboard or benchmark mistakes an emulated engine for a real one."""
    from prometheus_client import Gauge

    g = Gauge(
        EMULATED_METRIC,
        "1: this engine is EMULATED (steps sleep instead of running the model).",
        ["base_ms", "per_seq_ms", "per_token_ms"],
        registry=registry,
    )
    g.labels(
        f"{step_time.base_ms:g}", f"{step_time.per_seq_ms:g}", f"{step_time.per_token_ms:g}"
    ).set(1)
