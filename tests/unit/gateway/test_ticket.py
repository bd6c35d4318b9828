"""``Admission`` and ``Ticket`` alone: what closing a ticket releases, in which order, and who
closes it (the ``admit`` block, or the owner that took it over)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from dsv4_serving.gateway.lifecycle import Admission, carries_text
from dsv4_serving.gateway.metrics import GatewayMetrics


def _sample(m: GatewayMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def _statuses(m: GatewayMetrics) -> dict[str, float]:
    counts = {
        s: _sample(m, "dsv4_gateway_requests_total", status=s)
        for s in ("ok", "error", "cancelled", "rejected")
    }
    return {s: n for s, n in counts.items() if n}


def test_closing_releases_held_resources_then_the_slot_then_counts_once() -> None:
    m = GatewayMetrics()
    admission = Admission(2, m)
    events: list[str] = []

    @contextmanager
    def load(name: str) -> Iterator[None]:
        events.append(f"+{name}")
        yield
        events.append(f"-{name} inflight={admission.inflight}")

    with admission.admit() as ticket:
        assert admission.inflight == 1 and _sample(m, "dsv4_gateway_inflight_requests") == 1
        ticket.hold(load("prefill"))
        ticket.hold(load("decode"))
        ticket.outcome = "ok"
    assert events == ["+prefill", "+decode", "-decode inflight=1", "-prefill inflight=1"]
    assert admission.inflight == 0 and _sample(m, "dsv4_gateway_inflight_requests") == 0
    assert _statuses(m) == {"ok": 1}
    assert _sample(m, "vllm:e2e_request_latency_seconds_count") == 1


@pytest.mark.parametrize(
    ("exc", "status"), [(RuntimeError("bug"), "error"), (asyncio.CancelledError(), "cancelled")]
)
def test_an_exception_in_the_block_closes_the_ticket_under_its_status(
    exc: BaseException, status: str
) -> None:
    m = GatewayMetrics()
    admission = Admission(2, m)
    with pytest.raises(type(exc)), admission.admit():
        raise exc
    assert admission.inflight == 0 and _statuses(m) == {status: 1}
    assert _sample(m, "vllm:e2e_request_latency_seconds_count") == 0


def test_an_outcome_left_unset_counts_as_an_error() -> None:
    m = GatewayMetrics()
    with Admission(2, m).admit():
        pass
    assert _statuses(m) == {"error": 1}


def test_a_ticket_taken_over_is_closed_by_its_new_owner_only() -> None:
    m = GatewayMetrics()
    admission = Admission(2, m)
    released: list[str] = []
    with admission.admit() as ticket:
        ticket.closer.callback(released.append, "connection")
        owner = ticket.take_over()
    assert released == [] and admission.inflight == 1 and _statuses(m) == {}
    ticket.chunk(b'data: {"choices": [{"text": "a"}]}\n\n')
    ticket.chunk(b'data: {"choices":[{"text":"b","finish_reason":null}]}\n\n')
    ticket.chunk(b'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\n')
    ticket.chunk(b"data: [DONE]\n\n")
    ticket.outcome = "ok"
    owner.close()
    assert released == ["connection"] and admission.inflight == 0
    assert _statuses(m) == {"ok": 1}
    assert _sample(m, "vllm:time_to_first_token_seconds_count") == 1
    assert _sample(m, "vllm:inter_token_latency_seconds_count") == 1


def test_admission_is_full_at_its_limit_and_rejections_are_counted() -> None:
    m = GatewayMetrics()
    admission = Admission(1, m)
    with admission.admit():
        assert admission.full
        admission.reject()
    assert not admission.full
    assert _statuses(m) == {"rejected": 1, "error": 1}


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        (b'data: {"choices": [{"index": 0, "text": "hi"}]}\n\n', True),
        (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', True),
        (b'data: {"choices":[{"delta":{"reasoning_content":"why"}}]}\n\n', True),
        (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', True),
        (b'data: {"choices": [{"text": "", "finish_reason": null}]}\n\n', True),
        (b'data: {"choices":[{"delta":{"content":null}}]}\n\n', False),
        (b'data: {"choices": [{"text": "", "finish_reason": "stop"}]}\n\n', False),
        (b'data: {"choices": [], "usage": {"completion_tokens": 16}}\n\n', False),
        (b"data: [DONE]\n\n", False),
        (b'data: {"choices": [{"text": ""}]}\n\ndata: {"choices": [{"text": "z"}]}\n\n', True),
        (b'"text":', False),  # cut off after the key
    ],
)
def test_a_chunk_times_a_token_only_when_it_carries_text(chunk: bytes, expected: bool) -> None:
    assert carries_text(chunk) is expected
