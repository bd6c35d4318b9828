"""The engine core's spans of traced requests (``--otlp-traces-endpoint``).

The core records its own spans, in its own process (it has its own exporter): each request
that arrives with a ``traceparent`` (the API server's span of it) gets

    dsv4.engine.queue          arrival at the front end -> first scheduled (prefix-cache hit tokens)
    dsv4.kv.pull               decode: parked with fresh blocks -> its remote KV is in them
    dsv4.engine.prefill_chunk  one per step that computed prompt tokens (tokens, context)
    dsv4.kv.export             prefill: reserve + copy + commit of its KV at the sidecar
    dsv4.engine.decode         first decode step -> finish (tokens, steps, MTP drafts/accepted,
                               finish reason)

The KV spans are live while the sidecar is called: their ``traceparent`` goes with the call, so
the sidecars' spans are their children. ``EngineCore`` holds a ``CoreTracing`` only when
tracing is on; off, the core tests one ``None`` per step and nothing here runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsv4_common import tracing
from dsv4_serving.engine.core.sched.scheduler import RunnerResult, Scheduler, SchedulerOutput
from dsv4_serving.engine.kv_connector.metadata import KVConnectorOutput, SaveSpec
from dsv4_serving.engine.request import EngineCoreOutput, EngineCoreRequest

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer


@dataclass(slots=True)
class _Traced:
    parent: Context
    num_prompt_tokens: int
    queue: Span | None
    pull: Span | None = None
    kv: Span | None = None  # the KV span being worked on now (its traceparent goes to the sidecar)
    decode: Span | None = None
    chunks: int = 0
    decode_steps: int = 0
    output_tokens: int = 0
    drafts: int = 0
    accepted: int = 0


class CoreTracing:
    def __init__(self, tracer: Tracer, role: str) -> None:
        self.tracer = tracer
        self.role = role
        self.requests: dict[str, _Traced] = {}

    # ---- requests in and out -------------------------------------------------------------

    def add(self, req: EngineCoreRequest) -> None:
        parent = tracing.from_traceparent(req.traceparent)
        if parent is None:
            return
        start = int(req.arrival_time * 1e9)
        queue = tracing.start(
            self.tracer,
            "dsv4.engine.queue",
            parent,
            {"dsv4.role": self.role, tracing.GEN_AI_INPUT_TOKENS: len(req.prompt_token_ids)},
            start_ns=start,
        )
        self.requests[req.request_id] = _Traced(parent, len(req.prompt_token_ids), queue)

    def aborted(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            t = self.requests.pop(rid, None)
            if t is not None:
                for s in (t.queue, t.pull, t.kv, t.decode):
                    if s is not None:
                        tracing.fail(s, "aborted")
                        s.end()

    def traceparent(self, request_id: str) -> str | None:
        """The KV span of ``request_id`` the sidecar call being made belongs to."""
        t = self.requests.get(request_id)
        return tracing.traceparent(t.kv) if t is not None and t.kv is not None else None

    # ---- one step ------------------------------------------------------------------------

    def scheduled(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        """After ``schedule``: requests admitted (queue ends) or parked for remote KV."""
        for s in out.scheduled:
            t = self.requests.get(s.request_id)
            if t is not None and t.queue is not None:
                req = scheduler.requests[s.request_id]
                t.queue.set_attribute("dsv4.prefix_cache.hit_tokens", max(req.num_cached_tokens, 0))
                t.queue.end()
                t.queue = None
        for rid in scheduler.waiting_for_remote_kv:
            t = self.requests.get(rid)
            if t is not None and t.pull is None:
                if t.queue is not None:
                    t.queue.end()
                    t.queue = None
                t.pull = t.kv = tracing.start(
                    self.tracer, "dsv4.kv.pull", t.parent, {"dsv4.role": self.role}
                )

    def loaded(self, done: KVConnectorOutput) -> None:
        """Pulls that ended: the KV is in the blocks (or the failure policy applies)."""
        for rid, ok in [(r, True) for r in done.loaded] + [(r, False) for r in done.failed]:
            t = self.requests.get(rid)
            if t is None or t.pull is None:
                continue
            if not ok:
                failure = done.failed[rid]
                t.pull.set_attribute("dsv4.kv.failure", failure.reason)
                tracing.fail(t.pull, failure.message)
            t.pull.end()
            if t.kv is t.pull:
                t.kv = None

    def stepped(
        self, out: SchedulerOutput, results: dict[str, RunnerResult], start_ns: int
    ) -> None:
        """After the forward: a prefill chunk span per traced request that computed prompt
        tokens; decode steps are counted into one decode span."""
        end_ns = time.time_ns()
        for s in out.scheduled:
            t = self.requests.get(s.request_id)
            if t is None:
                continue
            r = results.get(s.request_id) if s.sample else None
            if s.context_len < t.num_prompt_tokens:
                t.chunks += 1
                tracing.record(
                    self.tracer,
                    "dsv4.engine.prefill_chunk",
                    t.parent,
                    start_ns,
                    end_ns,
                    {
                        "dsv4.chunk.index": t.chunks - 1,
                        "dsv4.chunk.tokens": len(s.token_ids),
                        "dsv4.chunk.context_tokens": s.context_len,
                        "dsv4.step.batched_tokens": out.num_batched_tokens,
                        "dsv4.step.requests": len(out.scheduled),
                    },
                )
            else:
                if t.decode is None:
                    t.decode = tracing.start(
                        self.tracer, "dsv4.engine.decode", t.parent, start_ns=start_ns
                    )
                t.decode_steps += 1
                t.drafts += s.num_spec
                if r is not None and s.num_spec:
                    t.accepted += len(r.token_ids) - 1

    @contextmanager
    def export(self, saves: list[SaveSpec]) -> Iterator[None]:
        """Around the KV exports of this step: a span per traced request (the saves run one
        after another, so each gets the whole call; ``kv`` names the one the sidecar hears)."""
        spans = []
        for s in saves:
            t = self.requests.get(s.request_id)
            if t is not None:
                t.kv = tracing.start(
                    self.tracer,
                    "dsv4.kv.export",
                    t.parent,
                    {"dsv4.role": self.role, "dsv4.kv.tokens": s.num_tokens},
                )
                spans.append(t)
        try:
            yield
        finally:
            for t in spans:
                if t.kv is not None:
                    t.kv.end()
                    t.kv = None

    def finished(self, outputs: list[EngineCoreOutput]) -> None:
        """After the step's outputs are final (KV saved): tokens counted, finished requests'
        spans ended with their usage and finish reason."""
        for o in outputs:
            t = self.requests.get(o.request_id)
            if t is None:
                continue
            t.output_tokens += len(o.new_token_ids)
            if o.finish_reason is None:
                continue
            del self.requests[o.request_id]
            if t.queue is not None:
                t.queue.end()
            attrs: dict[str, Any] = {
                tracing.GEN_AI_FINISH: [o.finish_reason],
                tracing.GEN_AI_INPUT_TOKENS: t.num_prompt_tokens,
                tracing.GEN_AI_OUTPUT_TOKENS: t.output_tokens,
                "dsv4.prefix_cache.hit_tokens": o.num_cached_tokens,
                "dsv4.engine.prefill_chunks": t.chunks,
                "dsv4.engine.decode_steps": t.decode_steps,
                "dsv4.mtp.draft_tokens": t.drafts,
                "dsv4.mtp.accepted_tokens": t.accepted,
            }
            if t.drafts:
                attrs["dsv4.mtp.acceptance_rate"] = round(t.accepted / t.drafts, 4)
            if o.error is not None:
                attrs["dsv4.kv.failure"] = o.error.reason
            span = t.decode
            if span is None:  # a prefill for a remote decode: its one token came with the prompt
                now = time.time_ns()
                span = tracing.start(self.tracer, "dsv4.engine.finish", t.parent, start_ns=now)
            span.set_attributes(attrs)
            if o.error is not None:
                tracing.fail(span, o.error.message)
            span.end()
