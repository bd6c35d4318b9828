"""The gateway's spans (dsv4_serving.gateway.tracing) as exported: the request span with the
X-Request-Id, its attempts as children (a retry a sibling, a 5xx or an exception an error), the
attempt's traceparent upstream, a client's traceparent honoured, tracing off making nothing."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from dsv4_common.light_spans import Recorder, parse_traceparent
from dsv4_serving.gateway import tracing as gt
from dsv4_serving.gateway.instances import Instance
from dsv4_serving.gateway.policies import Choice

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
BODY = {"model": "m", "prompt": "p", "max_tokens": 16, "stream": True}


@pytest.fixture
def sent() -> list[bytes]:
    return []


@pytest.fixture
def recorder(sent: list[bytes]) -> Recorder:
    return Recorder("http://c/v1/traces", "dsv4-gateway", schedule_s=None, post=sent.append)


def _spans(recorder: Recorder, sent: list[bytes]) -> dict[str, list[PbSpan]]:
    recorder.flush()
    out: dict[str, list[PbSpan]] = {}
    for body in sent:
        for s in ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans:
            out.setdefault(s.name, []).append(s)
    return out


def _attrs(span: PbSpan) -> dict[str, object]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def _choice(url: str, rank: int = 0, cached: int = 0) -> Choice:
    return Choice(Instance(url, "prefill", dp_size=2), rank, cached)


def test_a_request_with_a_retried_prefill_and_a_decode(
    recorder: Recorder, sent: list[bytes]
) -> None:
    headers: list[str] = []
    with (
        gt.request_span(recorder, {}, BODY, False, "rid-1", lambda: "ok") as root,
        gt.routing(root),
    ):
        for attempt, (url, status) in enumerate([("http://a", 500), ("http://b", 200)]):
            with gt.attempt_span(recorder, "prefill", _choice(url, 1, 32), attempt, "dplb") as a:
                headers.append(a.traceparent())
                gt.upstream_status(a, status)
        with gt.attempt_span(recorder, "decode", _choice("http://d"), 0, "dplb") as a:
            headers.append(a.traceparent())
            gt.upstream_status(a, 200)
    got = _spans(recorder, sent)
    (req,) = got["text_completion m"]
    failed, retry = got["dsv4.gateway.prefill"]
    (decode,) = got["dsv4.gateway.decode"]
    assert req.kind == PbSpan.SPAN_KIND_SERVER and req.parent_span_id == b""
    assert _attrs(req) == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": "m",
        "dsv4.request_id": "rid-1",
        "dsv4.stream": True,
        "gen_ai.request.max_tokens": 16,
        "dsv4.gateway.outcome": "ok",
    }
    assert req.status.code == 0
    for s in (failed, retry, decode):
        assert s.kind == PbSpan.SPAN_KIND_CLIENT
        assert s.parent_span_id == req.span_id and s.trace_id == req.trace_id
        assert req.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano
        assert s.end_time_unix_nano <= req.end_time_unix_nano
    assert failed.end_time_unix_nano <= retry.start_time_unix_nano
    assert _attrs(failed) == {
        "dsv4.role": "prefill",
        "dsv4.gateway.policy": "dplb",
        "dsv4.gateway.attempt": 0,
        "server.address": "http://a",
        "dsv4.dp_rank": 1,
        "dsv4.gateway.predicted_cached_tokens": 32,
        "http.response.status_code": 500,
    }
    assert (failed.status.code, failed.status.message) == (2, "upstream answered 500")
    assert _attrs(retry)["dsv4.gateway.attempt"] == 1 and retry.status.code == 0
    assert _attrs(decode)["dsv4.role"] == "decode" and decode.status.code == 0
    # each attempt's traceparent names that attempt as the engine's parent
    trace_id = int.from_bytes(req.trace_id, "big")
    assert [parse_traceparent(h) for h in headers] == [
        (trace_id, int.from_bytes(s.span_id, "big"), True) for s in (failed, retry, decode)
    ]


def test_a_client_traceparent_is_the_parent_and_a_failure_is_an_error(
    recorder: Recorder, sent: list[bytes]
) -> None:
    with (
        pytest.raises(TimeoutError),
        gt.request_span(
            recorder, {"traceparent": CLIENT}, {"model": "m"}, True, "rid-2", lambda: None
        ) as root,
        gt.routing(root),
        gt.attempt_span(recorder, "decode", _choice("http://d"), 0, "dplb"),
    ):
        raise TimeoutError("slow")
    got = _spans(recorder, sent)
    (req,) = got["chat m"]
    (attempt,) = got["dsv4.gateway.decode"]
    assert req.trace_id.hex() == CLIENT[3:35]
    assert req.parent_span_id.hex() == CLIENT[36:52]
    assert _attrs(req)["dsv4.gateway.outcome"] == "error"
    assert "gen_ai.request.max_tokens" not in _attrs(req)
    assert (req.status.code, req.status.message) == (2, "the request failed")
    assert (attempt.status.code, attempt.status.message) == (2, "TimeoutError: slow")
    assert attempt.parent_span_id == req.span_id


def test_the_request_span_is_the_parent_in_tasks_created_while_routing(
    recorder: Recorder, sent: list[bytes]
) -> None:
    async def attempt() -> None:
        await asyncio.sleep(0)
        with gt.attempt_span(recorder, "decode", _choice("http://d"), 0, "p"):
            pass

    async def main() -> None:
        with gt.request_span(recorder, {}, BODY, False, "rid-3", lambda: "ok") as root:
            with gt.routing(root):
                task = asyncio.ensure_future(attempt())
            await task  # done after routing's block: the context was copied at creation

    asyncio.run(main())
    got = _spans(recorder, sent)
    assert got["dsv4.gateway.decode"][0].parent_span_id == got["text_completion m"][0].span_id


def test_off_makes_nothing() -> None:
    assert gt.setup(None) is None
    with gt.attempt_span(None, "prefill", _choice("http://a"), 0, "dplb") as a:
        assert a is None
        gt.upstream_status(a, 500)
