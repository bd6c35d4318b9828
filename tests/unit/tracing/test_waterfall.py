"""`dsv4 trace`'s waterfall of a Jaeger trace: exact text (order, indentation, bars, columns)."""

from __future__ import annotations

from typing import Any

from dsv4_serving.traces.waterfall import ordered, parse_jaeger, render


def _span(sid: str, name: str, parent: str | None, start: int, dur: int, proc: str, **tags: Any):  # type: ignore[no-untyped-def]
    refs = [{"refType": "CHILD_OF", "traceID": "t1", "spanID": parent}] if parent else []
    return {
        "spanID": sid,
        "operationName": name,
        "references": refs,
        "startTime": start,
        "duration": dur,
        "processID": proc,
        "tags": [{"key": k.replace("__", "."), "value": v} for k, v in tags.items()],
    }


TRACE = {
    "traceID": "t1",
    "processes": {
        "p1": {"serviceName": "dsv4-gateway"},
        "p2": {"serviceName": "dsv4-engine-prefill"},
    },
    "spans": [
        # listed out of order on purpose: the waterfall orders them
        _span("d", "dsv4.gateway.decode", "a", 1_041_000, 59_000, "p1", dsv4__kv__bytes=4096),
        _span("a", "text_completion m", None, 1_000_000, 100_000, "p1", dsv4__request_id="r1"),
        _span("c", "text_completion m", "b", 1_001_000, 38_000, "p2", otel__status_code="ERROR"),
        _span(
            "b",
            "dsv4.gateway.prefill",
            "a",
            1_000_500,
            40_000,
            "p1",
            server__address="http://e",
            dsv4__dp_rank=0,
        ),
    ],
}


def test_spans_are_ordered_depth_first_by_start() -> None:
    spans = parse_jaeger(TRACE)
    assert [(d, s.span_id) for d, s in ordered(spans)] == [(0, "a"), (1, "b"), (2, "c"), (1, "d")]
    by_id = {s.span_id: s for s in spans}
    assert by_id["c"].service == "dsv4-engine-prefill" and by_id["c"].error
    assert by_id["b"].parent_id == "a" and by_id["a"].parent_id is None


def test_render_is_exact() -> None:
    assert render(parse_jaeger(TRACE), width=10, title="T") == (
        "T\n"
        "      start   duration                service              span\n"
        "     +0.0ms    100.0ms  |##########|  dsv4-gateway         text_completion m       request=r1\n"
        "     +0.5ms     40.0ms  |####      |  dsv4-gateway           dsv4.gateway.prefill  to=http://e rank=0\n"
        "     +1.0ms     38.0ms  |####      |  dsv4-engine-prefill      text_completion m    ERROR\n"
        "    +41.0ms     59.0ms  |    ######|  dsv4-gateway           dsv4.gateway.decode   bytes=4096\n"
    )


def test_a_span_whose_parent_is_missing_is_a_root() -> None:
    spans = parse_jaeger({**TRACE, "spans": [_span("x", "late", "gone", 5, 1, "p1")]})
    assert render(spans, width=8).splitlines()[1].endswith("late")


def test_no_spans() -> None:
    assert render([]) == "(no spans)\n"
