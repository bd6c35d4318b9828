"""Streams survive their engine: SIGKILL the engine serving a greedy stream mid-answer and the
client (the openai SDK) still gets one unbroken stream, token for token the uninterrupted
run's, continued by another engine (``gateway/stream_state.py``,
``entrypoints/continuation.py``). Real engines (dsv4-tiny) and gateways on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dsv4_common.process import Service
from tests.gateway.conftest import engine, gateway, pd_pair, running

MODEL = "dsv4-tiny"
PROMPT = "The quick brown fox jumps over the lazy dog."
MAX_TOKENS = 300
KILL_AFTER = 20  # chunks


@pytest.fixture(scope="module")
def solo() -> Iterator[Service]:
    # one token per step (no MTP drafts): a cut at any token is a cut between increments, and
    # seeded draws are exact only without drafts (``engine/sample/seeding.py``)
    with running(engine("cont-engine", "--num-speculative-tokens", "0")) as (e,):
        yield e


@dataclass
class Streamed:
    """What the client saw of one stream."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    roles: int = 0
    ids: set[str] = field(default_factory=set)
    created: set[int] = field(default_factory=set)
    usage: Any = None
    finish: str | None = None


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180)


def _kill_the_busy_one(g: Service, engines: list[Service]) -> Service:
    """SIGKILL (the whole process group) the engine the gateway has a request in flight on."""
    busy = [
        i["url"]
        for i in httpx.get(f"{g.url}/instances", timeout=5).json()
        if i["inflight_requests"]
    ]
    victims = [e for e in engines if e.url in busy]
    assert len(victims) == 1, busy
    pid = victims[0].pid
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    return victims[0]


def _stream(url: str, chat: bool, kill: Any = None, seed: int | None = None) -> Streamed:
    """A stream of ``MAX_TOKENS`` tokens (EOS ignored), greedy or sampled with ``seed``, with
    its token ids; ``kill`` is called after ``KILL_AFTER`` chunks."""
    c = _client(url)
    common: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0 if seed is None else 1.0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    if chat:
        chunks = c.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **common)
    else:
        chunks = c.completions.create(prompt=PROMPT, **common)
    out = Streamed()
    for i, ch in enumerate(chunks):
        out.ids.add(ch.id)
        out.created.add(ch.created)
        if ch.usage is not None:
            out.usage = ch.usage
        for choice in ch.choices:
            out.token_ids += (choice.model_extra or {}).get("token_ids") or []
            out.finish = choice.finish_reason or out.finish
            if chat:
                delta = choice.delta
                out.roles += delta.role is not None
                out.text += delta.content or ""
                out.reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            else:
                out.text += choice.text
        if i == KILL_AFTER and kill is not None:
            kill()
    return out


def _settled(g: Service, status: str, want: float) -> float:
    """dsv4_gateway_requests_total{status}, once it reaches ``want`` (a stream's request is
    counted as its response closes, just after the client read its end) or after 5 s."""
    deadline = time.monotonic() + 5
    while (got := g.metric("dsv4_gateway_requests_total", status=status)) != want:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return got


def _migrations(g: Service, outcome: str) -> float:
    return g.metric("dsv4_gateway_stream_migrations_total", reason="broken", outcome=outcome)


def _assert_same(got: Streamed, want: Streamed, chat: bool) -> None:
    assert got.token_ids == want.token_ids
    assert len(got.token_ids) == MAX_TOKENS
    assert (got.text, got.reasoning) == (want.text, want.reasoning)
    assert got.finish == "length"
    assert len(got.ids) == 1 and len(got.created) == 1  # one answer
    assert got.roles == (1 if chat else 0)
    assert got.usage.completion_tokens == MAX_TOKENS
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    if chat:
        details = want.usage.completion_tokens_details
        assert got.usage.completion_tokens_details == details


@pytest.mark.parametrize(
    ("chat", "seed"),
    [(False, None), (True, None), (False, 7)],
    ids=["completions", "chat-thinking", "completions-seeded"],
)
def test_a_killed_engine_s_stream_continues_on_the_other(chat: bool, seed: int | None) -> None:
    # seeded draws continue exactly without MTP drafts (``engine/sample/seeding.py``)
    flags = () if seed is None else ("--num-speculative-tokens", "0")
    a, b = engine(f"cont-a-{chat}", *flags), engine(f"cont-b-{chat}", *flags)
    with (
        running(a, b),
        running(gateway("gateway-cont", "--engine", a.url, "--engine", b.url)) as (g,),
    ):
        want = _stream(g.url, chat, seed=seed)  # the uninterrupted run
        if chat:
            assert want.reasoning  # dsv4-tiny thinks by default: the kill lands in reasoning
        victim: list[Service] = []
        got = _stream(
            g.url, chat, kill=lambda: victim.append(_kill_the_busy_one(g, [a, b])), seed=seed
        )
        assert victim and not victim[0].running()
        _assert_same(got, want, chat)
        assert _migrations(g, "continued") == 1
        assert _settled(g, "ok", 2) == 2, g.metrics_text()


def test_a_killed_decode_engine_s_stream_continues_through_pd(token_file: Path) -> None:
    (ps, pe), (d0s, d0), (d1s, d1) = (
        pd_pair("cp", "prefill", token_file),
        pd_pair("cd0", "decode", token_file),
        pd_pair("cd1", "decode", token_file),
    )
    gw = gateway("gateway-cont-pd", "--prefill", pe.url, "--decode", d0.url, "--decode", d1.url)
    with running(ps, pe, d0s, d0, d1s, d1), running(gw) as (g,):
        want = _stream(g.url, chat=False)
        got = _stream(g.url, chat=False, kill=lambda: _kill_the_busy_one(g, [d0, d1]))
        _assert_same(got, want, chat=False)
        assert _migrations(g, "continued") == 1


def test_without_another_engine_the_stream_ends_with_an_error_event() -> None:
    a = engine("cont-alone")
    with running(a), running(gateway("gateway-alone", "--engine", a.url)) as (g,):
        t = time.monotonic()
        with pytest.raises(openai.APIError) as err:
            _stream(g.url, chat=False, kill=lambda: _kill_the_busy_one(g, [a]))
        assert time.monotonic() - t < 60
        assert "continuing it failed" in str(err.value)
        assert _migrations(g, "failed") == 1
        assert _settled(g, "error", 1) == 1, g.metrics_text()


PENALTIES = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.5}
NO_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


@pytest.mark.parametrize(
    ("stop", "seed", "extra"),
    [(None, None, {}), (["zzzzzz"], None, {}), (None, 7, {}), (None, 7, PENALTIES)],
    ids=["greedy-logprobs", "stop-held-back", "seeded", "seeded-penalties"],
)
def test_the_engine_continues_an_answer_exactly(
    solo: Service, stop: list[str] | None, seed: int | None, extra: dict[str, float]
) -> None:
    """The engine half alone: a stream continued from any cut of an answer (a character split
    across tokens, a stop string's held-back tail; greedy or seeded sampling; penalties, which
    count the tokens already sent as output) gives the rest of the uninterrupted one."""
    e = solo
    body: dict[str, Any] = {
        **extra,
        "stop": stop,
        "seed": seed,
        "logprobs": 1 if stop is None and seed is None else None,
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 40,
        "temperature": 0 if seed is None else 1.0,
        "ignore_eos": True,
        "stream": True,
        "continuation": {},
    }
    full = _raw(e.url, body)
    for cut in (1, 7, 20, 39):
        cont = {
            "token_ids": full.token_ids[:cut],
            "chars": full.chars[cut - 1],
            "id": full.head["id"],
            "created": full.head["created"],
        }
        rest = _raw(e.url, {**body, "continuation": cont})
        assert full.token_ids[:cut] + rest.token_ids == full.token_ids
        assert full.text[: full.chars[cut - 1]] + rest.text == full.text
        assert rest.chunk_ids == {full.head["id"]}
        assert full.offsets[cut:] == rest.offsets  # logprobs' text_offset goes on
    if extra:  # the penalties change the answer: the cuts above prove they were carried on
        assert _raw(e.url, {**body, **NO_PENALTIES}).token_ids != full.token_ids
    refused = httpx.post(
        f"{e.url}/v1/completions",
        json={**body, "continuation": {"token_ids": full.token_ids}},
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continuation"


@dataclass
class _Raw:
    token_ids: list[int] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)  # characters sent after each token
    text: str = ""
    head: dict[str, Any] = field(default_factory=dict)
    chunk_ids: set[str] = field(default_factory=set)
    offsets: list[int] = field(default_factory=list)  # logprobs' text_offset


def _raw(url: str, body: dict[str, Any]) -> _Raw:
    """An engine's stream with its state blocks, read as the gateway reads it."""
    import json

    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = _Raw()
    for block in r.text.split("\n\n"):
        if block.startswith(": dsv4 "):
            state = json.loads(block[len(": dsv4 ") :])
            if "id" in state:
                out.head = state
            out.token_ids += state["t"]
            out.chars += [state["c"]] * len(state["t"])
        elif block.startswith("data: {"):
            chunk = json.loads(block[len("data: ") :])
            out.chunk_ids.add(chunk["id"])
            for c in chunk["choices"]:
                out.text += c["text"]
                out.offsets += (c["logprobs"] or {}).get("text_offset", [])
    return out
