"""``n`` > 1 under PD (``gateway/fanout.py``): each choice's request, and the merged answer and
stream as OpenAI gives them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import JSONResponse, Response

from dsv4_serving.gateway.fanout import (
    MAX_N,
    StreamMerger,
    choice_bodies,
    fan_out,
    fan_out_n,
    merge_answers,
    merge_usage,
)
from dsv4_serving.gateway.lifecycle import Ticket
from dsv4_serving.gateway.metrics import GatewayMetrics


def test_fan_out_only_for_a_well_formed_n_above_one() -> None:
    assert [fan_out_n({"n": v}) for v in (2, 1, 0, True, "3", None)] == [2, 1, 1, 1, 1, 1]
    assert fan_out_n({}) == 1


def test_choice_i_gets_n_1_and_the_engines_seed_for_sample_i() -> None:
    bodies = choice_bodies({"prompt": "x", "n": 3, "seed": 2**63 - 2}, 3)
    assert [b["n"] for b in bodies] == [1, 1, 1]
    assert [b["seed"] for b in bodies] == [2**63 - 2, 2**63 - 1, 0]  # seed + i, mod 2**63
    assert all("seed" not in b for b in choice_bodies({"n": 2}, 2))


def _usage(prompt: int, completion: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def test_usage_counts_the_prompt_once_and_sums_the_completions() -> None:
    assert merge_usage([_usage(7, 3, 0, 1), _usage(7, 5, 4, 2)]) == {
        "prompt_tokens": 7,
        "completion_tokens": 8,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }


def test_answers_merge_into_indexed_choices() -> None:
    answers = [
        {"id": f"cmpl-{i}", "choices": [{"index": 0, "text": t}], "usage": _usage(2, 1, 0, 0)}
        for i, t in enumerate("ab")
    ]
    merged = merge_answers(answers)
    assert merged["id"] == "cmpl-0"
    assert merged["choices"] == [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]
    assert merged["usage"]["completion_tokens"] == 2


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _events(data: bytes) -> list[Any]:
    out = []
    for e in data.split(b"\n\n"):
        if e:
            payload = e.removeprefix(b"data: ")
            out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


def test_streams_interleave_reindexed_with_one_usage_chunk_and_one_done() -> None:
    m = StreamMerger(2, include_usage=True)

    def chunk(i: int, text: str) -> dict[str, Any]:
        return {"id": f"c{i}", "created": i, "choices": [{"index": 0, "text": text}]}

    def usage(i: int) -> dict[str, Any]:
        return {"id": f"c{i}", "created": i, "choices": [], "usage": _usage(2, 1, 0, 0)}

    one = _sse(chunk(1, "B"))
    out = m.feed(0, _sse(chunk(0, "A")))
    out += m.feed(1, one[:9])  # an event split over two chunks goes out whole
    out += m.feed(1, one[9:] + _sse(usage(1)) + b"data: [DONE]\n\n")
    out += m.feed(0, _sse(usage(0)) + b"data: [DONE]\n\n")
    out += m.finish()
    events = _events(out)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    texts = [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:2]]
    assert texts == [(0, "A"), (1, "B")]
    assert {(e["id"], e["created"]) for e in events[:-1]} == {("c0", 0)}
    assert events[2]["choices"] == [] and events[2]["usage"]["completion_tokens"] == 2


def test_no_usage_chunk_unless_asked() -> None:
    m = StreamMerger(1, include_usage=False)
    m.feed(0, _sse({"id": "c", "choices": [], "usage": _usage(2, 1, 0, 0)}))
    assert m.finish() == b"data: [DONE]\n\n"


def test_an_error_event_passes_through_and_marks_the_stream() -> None:
    m = StreamMerger(2, include_usage=False)
    err = _sse({"error": {"message": "upstream broke off", "code": "upstream_error"}})
    assert _events(m.feed(1, b"\n\n" + err + b"data: [DONE]\n\n"))[0]["error"]
    assert m.errored


def _run_choices(
    fail_prefill: int | None = None,
) -> tuple[Callable[..., Awaitable[Response]], list[str]]:
    """A fake PD request per choice: its log of events, and a 400 from a failing prefill."""
    log: list[str] = []

    async def run(body: dict[str, Any], prefilled: Callable[[], None]) -> Response:
        i = body["seed"] - 10
        log.append(f"prefill {i}")
        await asyncio.sleep(0.01)
        if i == fail_prefill:
            return JSONResponse({"error": {"message": f"bad {i}"}}, status_code=400)
        prefilled()
        answer = {
            "id": f"c{i}",
            "choices": [{"index": 0, "text": str(i)}],
            "usage": _usage(3, 2, 0, 0),
        }
        return JSONResponse(answer)

    return run, log


def _fan_out(n: int, run: Callable[..., Awaitable[Response]]) -> Response:
    ticket = Ticket(GatewayMetrics())
    body = {"prompt": "p", "n": n, "seed": 10}
    return asyncio.run(fan_out(n, body, run, ticket, "rid"))


def test_choice_0_prefills_alone_then_the_others_and_the_answers_merge() -> None:
    run, log = _run_choices()
    resp = _fan_out(3, run)
    assert log[0] == "prefill 0" and sorted(log[1:]) == ["prefill 1", "prefill 2"]
    answer = json.loads(bytes(resp.body))
    assert [c["text"] for c in answer["choices"]] == ["0", "1", "2"]
    assert answer["usage"]["completion_tokens"] == 6 and answer["usage"]["prompt_tokens"] == 3


def test_a_failed_first_prefill_is_the_answer_and_nothing_else_runs() -> None:
    run, log = _run_choices(fail_prefill=0)
    resp = _fan_out(2, run)
    assert resp.status_code == 400 and log == ["prefill 0"]


def test_a_failed_later_choice_fails_the_request() -> None:
    run, _ = _run_choices(fail_prefill=1)
    resp = _fan_out(2, run)
    assert resp.status_code == 400 and b"bad 1" in bytes(resp.body)


def test_n_above_openais_limit_is_a_400_naming_n() -> None:
    run, log = _run_choices()
    resp = _fan_out(MAX_N + 1, run)
    assert resp.status_code == 400 and json.loads(bytes(resp.body))["error"]["param"] == "n"
    assert log == []
