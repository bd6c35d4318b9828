"""PD through the gateway, and through vLLM's own router, on real engines and sidecars: the same
tokens as one engine doing both (greedy); `dsv4 up` end to end; load and a dying decode engine."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dsv4_common.process import Service, dsv4_argv, free_port
from dsv4_devcluster.vllm_router import ensure_vllm_router, router_argv
from tests.gateway.conftest import LOG_DIR, engine, gateway, pd_pair, routed_counts, running

PROMPTS = [
    "hello world",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 7,  # past the 128-token window
    "0123456789" * 25,
]


@pytest.fixture(scope="module")
def reference() -> Iterator[Service]:
    with running(engine("engine-reference")) as (ref,):
        yield ref


class Up(Service):
    """``dsv4 up``: the whole local stack, its children's logs in ``log_dir``."""

    def __init__(self, *extra: str) -> None:
        port = free_port()
        self.log_dir = Path(tempfile.mkdtemp(prefix="dsv4-up-test-"))
        argv = dsv4_argv("up", "--port", str(port), "--log-dir", str(self.log_dir), *extra)
        super().__init__(
            "dsv4-up", argv, LOG_DIR / f"dsv4-up-{port}.log", f"http://127.0.0.1:{port}"
        )

    def failure_report(self) -> str:
        logs = "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted(self.log_dir.glob("*.log"))
        )
        return f"----- dsv4 up\n{self.tail(40)}\n{logs}"


@contextlib.contextmanager
def up_running(*extra: str, timeout_s: float = 240) -> Iterator[Up]:
    """``dsv4 up *extra`` until it says it is up; stopped cleanly on the way out."""
    stack = Up(*extra)
    stack.start(env={"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout_s
    while "dsv4 is up" not in stack.tail(60):
        assert stack.running(), stack.failure_report()
        assert time.monotonic() < deadline, stack.failure_report()
        time.sleep(0.5)
    yield stack
    stack.stop(timeout_s=60)
    assert stack.exit_code() == 0, stack.failure_report()
    assert "stopped." in stack.tail(5)


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    with up_running() as stack:
        yield stack


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180)


def _complete(url: str, prompt: str, stream: bool, max_tokens: int = 16) -> str:
    c = _client(url)
    if stream:
        return "".join(
            ch.choices[0].text
            for ch in c.completions.create(
                model="dsv4-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
            if ch.choices
        )
    return (
        c.completions.create(model="dsv4-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
        .choices[0]
        .text
    )


def _chat_answer(url: str, msgs: list[Any]) -> tuple[str, str]:
    """(reasoning, content): dsv4-tiny speaks V4's format and thinks by default."""
    msg = (
        _client(url)
        .chat.completions.create(model="dsv4-tiny", messages=msgs, max_tokens=12, temperature=0)
        .choices[0]
        .message
    )
    return getattr(msg, "reasoning_content", None) or "", msg.content or ""


def test_up_serves_pd_with_the_same_tokens(up: Up, reference: Service) -> None:
    roles = {i["role"] for i in httpx.get(f"{up.url}/instances", timeout=10).json()}
    assert roles == {"prefill", "decode"}
    for prompt in PROMPTS:
        want = _complete(reference.url, prompt, stream=False)
        assert _complete(up.url, prompt, stream=False) == want
        assert _complete(up.url, prompt, stream=True) == want
    msgs: list[Any] = [{"role": "user", "content": "Tell me a story."}]
    want_chat = _chat_answer(reference.url, msgs)
    assert "".join(want_chat), "the engine answered nothing to compare"
    got = _chat_answer(up.url, msgs)
    assert got == want_chat
    counts = routed_counts(up)
    assert len(counts) == 2 and all(v > 0 for v in counts.values())


def _n_choices(url: str, stream: bool, **kw: Any) -> tuple[list[str], tuple[int, int]]:
    """``n=2`` completions: each choice's text by index, and (prompt, completion) tokens."""
    c = _client(url)
    args: dict[str, Any] = {"model": "dsv4-tiny", "prompt": PROMPTS[0], "max_tokens": 10, "n": 2}
    texts = ["", ""]
    if not stream:
        r = c.completions.create(**args, **kw)
        for choice in r.choices:
            texts[choice.index] += choice.text
        assert r.usage is not None
        return texts, (r.usage.prompt_tokens, r.usage.completion_tokens)
    usage = None
    chunks = c.completions.create(**args, **kw, stream=True, stream_options={"include_usage": True})
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
        if ch.usage is not None:
            assert usage is None, "one usage chunk"
            usage = (ch.usage.prompt_tokens, ch.usage.completion_tokens)
    assert usage is not None
    return texts, usage


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_n_2_through_pd_gives_one_engines_choices(
    up: Up, reference: Service, sampling: str
) -> None:
    kw: dict[str, Any] = (
        {"temperature": 0} if sampling == "greedy" else {"temperature": 1.0, "seed": 1234}
    )
    want, want_usage = _n_choices(reference.url, False, **kw)
    # greedy: both choices are the one greedy answer; seeded: choice 1 has its own seed
    assert (want[0] == want[1]) == (sampling == "greedy")
    for stream in (False, True):
        assert _n_choices(up.url, stream, **kw) == (want, want_usage), f"stream={stream}"


def test_n_2_chat_streamed_through_pd_gives_one_engines_choices(up: Up, reference: Service) -> None:
    args: dict[str, Any] = {
        "model": "dsv4-tiny",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 8,
        "n": 2,
        "temperature": 0.8,
        "seed": 99,
    }
    # (reasoning, content) per choice: dsv4-tiny speaks V4's format and thinks by default
    want = [
        (getattr(c.message, "reasoning_content", None) or "", c.message.content or "")
        for c in _client(reference.url).chat.completions.create(**args).choices
    ]
    assert all("".join(w) for w in want), "a choice answered nothing to compare"
    parts: list[list[str]] = [["", ""], ["", ""]]
    for ch in _client(up.url).chat.completions.create(**args, stream=True):
        for c in ch.choices:
            parts[c.index][0] += getattr(c.delta, "reasoning_content", None) or ""
            parts[c.index][1] += c.delta.content or ""
    got = [tuple(p) for p in parts]
    assert got == want


def test_vllm_router_drives_our_engines(up: Up, reference: Service) -> None:
    router = ensure_vllm_router()
    if router is None:
        pytest.fail("vllm-router could not be installed from PyPI")
    insts = httpx.get(f"{up.url}/instances", timeout=10).json()
    prefill = next(i["url"] for i in insts if i["role"] == "prefill")
    decode = next(i["url"] for i in insts if i["role"] == "decode")
    port = free_port()
    argv = router_argv(router, [prefill], [decode], port)
    log = LOG_DIR / f"vllm-router-{port}.log"
    with running(Service("vllm-router", argv, log, f"http://127.0.0.1:{port}"), timeout_s=60) as (
        r,
    ):
        for prompt in PROMPTS:
            want = _complete(reference.url, prompt, stream=False)
            assert _complete(r.url, prompt, stream=False) == want, r.tail(30)
            assert _complete(r.url, prompt, stream=True) == want, r.tail(30)


def test_pd_under_load_survives_a_dead_decode_engine(reference: Service, token_file: Path) -> None:
    pairs = [pd_pair(f"p{i}", "prefill", token_file) for i in range(2)] + [
        pd_pair(f"d{i}", "decode", token_file) for i in range(2)
    ]
    args = [
        a
        for (_, e), role in zip(pairs, ["prefill", "prefill", "decode", "decode"], strict=True)
        for a in (f"--{role}", e.url)
    ]
    with (
        running(*(s for pair in pairs for s in pair)),
        running(gateway("gateway-pd", *args)) as (g,),
    ):

        async def load(n: int, kill_at: float | None) -> list[tuple[int, str, float]]:
            async with httpx.AsyncClient(timeout=180) as c:
                sem = asyncio.Semaphore(8)

                async def one(i: int) -> tuple[int, str, float]:
                    async with sem:
                        t = time.monotonic()
                        body = {
                            "model": "dsv4-tiny",
                            "prompt": f"load {i} " * (1 + i % 5),
                            "max_tokens": 24,
                            "ignore_eos": True,
                            "stream": True,
                        }
                        text = ""
                        async with c.stream("POST", f"{g.url}/v1/completions", json=body) as r:
                            async for line in r.aiter_lines():
                                text += line
                            return r.status_code, text, time.monotonic() - t

                tasks = [asyncio.create_task(one(i)) for i in range(n)]
                if kill_at is not None:
                    await asyncio.sleep(kill_at)
                    pairs[3][1].stop(timeout_s=1)  # decode engine d1 dies under load
                return await asyncio.gather(*tasks)

        results = asyncio.run(load(32, None))
        assert all(s == 200 and "[DONE]" in t for s, t, _ in results)
        counts = routed_counts(g)
        for role in ("prefill", "decode"):
            mine = [
                counts.get(e.url, 0.0)
                for (_, e), r in zip(pairs, ["prefill", "prefill", "decode", "decode"], strict=True)
                if r == role
            ]
            assert min(mine) >= 0.25 * sum(mine), (
                counts
            )  # both instances of each role take a real share

        results = asyncio.run(load(24, 1.5))
        for status, text, took in results:
            assert took < 120
            assert status in (200, 502, 503) and ("[DONE]" in text or "error" in text)
        ok = sum(1 for s, t, _ in results if s == 200 and '"error"' not in t)
        assert ok >= len(results) // 2
        for i in range(4):
            r = httpx.post(
                f"{g.url}/v1/completions",
                json={"model": "dsv4-tiny", "prompt": f"after {i}", "max_tokens": 4},
                timeout=120,
            )
            assert r.status_code == 200, r.text

        # a prefill engine dies too: its requests are retried on the other prefill engine
        pairs[1][1].stop(timeout_s=1)
        results = asyncio.run(load(8, None))
        assert all(s == 200 and "[DONE]" in t and '"error"' not in t for s, t, _ in results), (
            results
        )
        dead = pairs[1][1].url
        assert (
            g.metric("dsv4_gateway_retries_total", stage="prefill") > 0
            or g.metric("dsv4_gateway_ejections_total", instance=dead) == 1
        )


def test_selective_pd_sends_short_prompts_to_decode_alone(
    reference: Service, token_file: Path
) -> None:
    (ps, pe), (ds, de) = pd_pair("sp", "prefill", token_file), pd_pair("sd", "decode", token_file)
    selective = gateway(
        "gateway-selective", "--prefill", pe.url, "--decode", de.url, "--selective-pd-tokens", "64"
    )
    with running(ps, pe, ds, de), running(selective) as (g,):
        short, long = "hi there", "x" * 200
        for prompt in (short, long):
            assert _complete(g.url, prompt, stream=False) == _complete(
                reference.url, prompt, stream=False
            )
        counts = routed_counts(g)
        assert counts[pe.url] == 1  # only the long prompt was prefilled remotely
        assert counts[de.url] == 2
        assert g.metric("dsv4_gateway_selective_pd_total") == 1
