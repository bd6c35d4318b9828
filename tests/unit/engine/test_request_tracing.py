"""The engine core's spans of a traced request, on the real scheduler with a fake model and a
real OpenTelemetry SDK tracer (in memory): queue, one span per prefill chunk, one decode span
with the MTP counts the scheduler itself counted, all children of the API server's span."""

from __future__ import annotations

import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dsv4_common import tracing
from dsv4_serving.engine.core.sched.scheduler import Scheduler
from dsv4_serving.engine.engine.request_tracing import CoreTracing
from dsv4_serving.engine.request import EngineCoreRequest, Request
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from tests.unit.engine.test_scheduler import FakeRunner, make


def _run(sched: Scheduler, runner: FakeRunner, ct: CoreTracing) -> None:
    """EngineCore.step's calls, in its order."""
    for _ in range(200):
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()
        ct.scheduled(sched, out)
        t0 = time.time_ns()
        results = runner.execute(out)
        outputs = sched.update_from_output(out, results)
        ct.stepped(out, results, t0)
        ct.finished(outputs)
    raise AssertionError("did not finish")


def _setup(k: int = 0):  # type: ignore[no-untyped-def]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    sched, _ = make(budget=4, k=k)
    return tracer, exporter, sched, CoreTracing(tracer, "both")


def _add(sched, ct, rid, prompt, n, traceparent):  # type: ignore[no-untyped-def]
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    req = EngineCoreRequest(rid, prompt, sp, traceparent=traceparent)
    sched.add_request(Request(req, eos_token_id=None))
    ct.add(req)


def test_chunks_queue_and_decode_spans_of_a_traced_request() -> None:
    tracer, exporter, sched, ct = _setup()
    api = tracing.start(tracer, "api", None)
    _add(sched, ct, "a", list(range(1, 11)), 5, tracing.traceparent(api))
    _add(sched, ct, "b", [5, 6, 7], 2, None)  # untraced: no spans, no bookkeeping
    _run(sched, FakeRunner(), ct)
    api.end()
    spans = [s for s in exporter.get_finished_spans() if s.name != "api"]
    assert not ct.requests
    assert all(s.parent is not None and s.parent.span_id == api.context.span_id for s in spans)
    names = [s.name for s in sorted(spans, key=lambda s: (s.start_time, s.name))]
    assert names == [
        "dsv4.engine.queue",
        "dsv4.engine.prefill_chunk",
        "dsv4.engine.prefill_chunk",
        "dsv4.engine.prefill_chunk",
        "dsv4.engine.decode",
    ]
    chunks = [s.attributes for s in spans if s.name == "dsv4.engine.prefill_chunk"]
    # a 10-token prompt, a 4-token budget shared with "b" (3 tokens + 2 decode steps)
    assert [c["dsv4.chunk.tokens"] for c in chunks] == [4, 4, 2]
    assert [c["dsv4.chunk.context_tokens"] for c in chunks] == [0, 4, 8]
    (queue,) = [s for s in spans if s.name == "dsv4.engine.queue"]
    assert queue.attributes["dsv4.prefix_cache.hit_tokens"] == 0
    (decode,) = [s for s in spans if s.name == "dsv4.engine.decode"]
    a = decode.attributes
    assert a["gen_ai.usage.output_tokens"] == 5
    assert a["gen_ai.usage.input_tokens"] == 10
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["dsv4.engine.prefill_chunks"] == 3
    assert a["dsv4.engine.decode_steps"] == 4  # the first token came with the last chunk


def test_mtp_counts_match_the_schedulers() -> None:
    tracer, exporter, sched, ct = _setup(k=2)
    api = tracing.start(tracer, "api", None)
    _add(sched, ct, "a", [3, 1, 4], 9, tracing.traceparent(api))
    _run(sched, FakeRunner(k=2), ct)
    (decode,) = [s for s in exporter.get_finished_spans() if s.name == "dsv4.engine.decode"]
    a = decode.attributes
    assert a["dsv4.mtp.draft_tokens"] == sched.stats.spec_draft_tokens > 0
    assert a["dsv4.mtp.accepted_tokens"] == sched.stats.spec_accepted_tokens > 0
    assert a["dsv4.mtp.acceptance_rate"] == round(
        sched.stats.spec_accepted_tokens / sched.stats.spec_draft_tokens, 4
    )
    assert a["gen_ai.usage.output_tokens"] == 9


def test_an_aborted_request_ends_its_open_spans_as_errors() -> None:
    tracer, exporter, sched, ct = _setup()
    api = tracing.start(tracer, "api", None)
    _add(sched, ct, "a", [1, 2, 3], 4, tracing.traceparent(api))
    ct.aborted(sched.abort_requests(["a"]))
    (queue,) = exporter.get_finished_spans()
    assert queue.name == "dsv4.engine.queue"
    assert queue.status.status_code.name == "ERROR"
    assert not ct.requests
