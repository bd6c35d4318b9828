"""Prefix pulls chosen by the gateway, real engines, sidecars and gateways on 127.0.0.1
(dsv4-tiny, block size 16, no MTP, every sidecar with a host tier, every engine publishing KV
events):

- two engines that do both: one holds a 3.5K-token prefix and is busy with a long generation;
  a request sharing the prefix goes to the idle one, which pulls the prefix from the holder's
  sidecar (its counters: the prefix pulled, only the suffix computed) and answers the greedy
  tokens of a local hit on the holder;
- PD: turn 2 of a session, prefilled on the prefill engine, pulls turn 1's answer blocks from
  the decode engine's sidecar (announced by the decode's events) and decodes the same tokens.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_common.process import Service, free_ports
from dsv4_serving.commands.launch import TINY_ENGINE, PDInstance, engine_with_sidecar
from tests.gateway.conftest import _PD_PORTS, LOG_DIR, gateway, routed_counts, running

BS = 16
PREFIX = 3584  # 224 blocks: with a 400-token answer within dsv4-tiny's 4096 positions
ENGINE = ("--num-speculative-tokens", "0", "--async-scheduling", "off")


@dataclass
class Stack:
    a: Service  # both
    b: Service  # both, and the PD prefill
    d: Service  # decode
    both_gw: Service  # over a and b
    pd_gw: Service  # prefill b, decode d


@pytest.fixture(scope="module")
def stack(token_file_module: Path) -> Iterator[Stack]:
    # publisher and replay ports, kept apart from the engines' and sidecars' ports
    events = {name: f"tcp://127.0.0.1:{free_ports(2, _PD_PORTS)}" for name in "abd"}
    pairs: dict[str, PDInstance] = {
        name: engine_with_sidecar(
            f"pp-{name}",
            role,
            TINY_ENGINE,
            log_dir=LOG_DIR,
            token_file=token_file_module,
            taken=_PD_PORTS,
            shm_prefix="dsv4-test-pull",
            engine_args=(*ENGINE, "--kv-events-endpoint", events[name]),
            staging_bytes=256 << 20,
            kv_host_bytes=128 << 20,
        )
        for name, role in (("a", "both"), ("b", "both"), ("d", "decode"))
    }
    sidecars = [p.sidecar for p in pairs.values()]
    engines = [p.engine for p in pairs.values()]
    a, b, d = engines
    kv = [f"--kv-events={e.url}={events[n]}" for n, e in zip("abd", engines, strict=True)]
    both_gw = gateway("pp-both-gw", "--engine", a.url, "--engine", b.url, *kv[:2])
    pd_gw = gateway("pp-pd-gw", "--prefill", b.url, "--decode", d.url, *kv[1:])
    # the sidecars first: an engine asks its sidecar at start whether it keeps a host tier
    with running(*sidecars), running(*engines, timeout_s=600), running(both_gw, pd_gw):
        yield Stack(a, b, d, both_gw, pd_gw)


@pytest.fixture(scope="module")
def token_file_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pull-token") / "kv-token"
    path.write_text(secrets.token_urlsafe(24))
    return path


def _body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "dsv4-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 250 + 3 for i in range(n)]  # vocabulary: 264


def _wait(what: str, cond: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _kv(g: Service) -> dict[str, dict[str, Any]]:
    rows = httpx.get(f"{g.url}/instances", timeout=10).json()
    return {r["url"]: r["kv_events"]["ranks"][0] for r in rows}


def _pulled(e: Service, outcome: str = "pulled") -> float:
    return e.metric("dsv4_kv_prefix_tokens_total", outcome=outcome)


def _routed_to(g: Service, before: dict[str, float]) -> str:
    after = routed_counts(g)
    (url,) = [u for u in after if after[u] != before.get(u, 0.0)]
    return url


def test_a_busy_holder_leaves_the_request_to_an_idle_engine_that_pulls(stack: Stack) -> None:
    g = stack.both_gw
    _wait("both engines subscribed", lambda: all(r["next_seq"] for r in _kv(g).values()))
    prefix = _prompt(1, PREFIX)
    before = routed_counts(g)
    _complete(g.url, _body(prefix, 2))
    holder = _routed_to(g, before)
    idle = stack.b if holder == stack.a.url else stack.a
    held = stack.a if idle is stack.b else stack.b
    _wait("the holder's offer announced", lambda: _kv(g)[holder]["host_entries"] >= 1)

    # a long generation sharing the prefix: the holder, whose own cache has it, takes it
    long_body = _body([*prefix, *_prompt(2, 32)], 400, stream=True)
    started, done = threading.Event(), threading.Event()

    def generate() -> None:
        with httpx.stream("POST", f"{g.url}/v1/completions", json=long_body, timeout=300) as r:
            for _ in r.iter_lines():
                started.set()
        done.set()

    before = routed_counts(g)
    threading.Thread(target=generate, daemon=True).start()
    _wait("the long generation streams", started.is_set, 300)
    assert _routed_to(g, before) == holder

    # the request under test: the holder is busy, the idle engine pulls the prefix
    body = _body([*prefix, *_prompt(3, 40)], 16)
    pulled, recomputed = _pulled(idle), _pulled(idle, "recomputed")
    before = routed_counts(g)
    got = _complete(g.url, body)
    assert _routed_to(g, before) == idle.url
    n = _cached(got)
    # the deepest boundary the holder snapshotted: at most the prefix, within a block of it
    assert PREFIX - BS <= n <= PREFIX
    assert got["usage"]["prompt_tokens"] - n == len(body["prompt"]) - n  # only the suffix
    _wait("the idle engine counts the pull", lambda: _pulled(idle) == pulled + n, 20)
    assert _pulled(idle, "recomputed") == recomputed
    # the same greedy tokens as a local hit on the holder
    local = _complete(held.url, body)
    assert _cached(local) > 0
    assert _tokens(got) == _tokens(local)
    _wait("the long generation ends", done.is_set, 300)


def test_pd_turn_two_pulls_turn_ones_answer_from_the_decode(stack: Stack) -> None:
    g = stack.pd_gw
    _wait("engines subscribed", lambda: all(r["next_seq"] for r in _kv(g).values()))
    p1 = _prompt(6, 200)
    turn1 = _tokens(_complete(g.url, _body(p1, 100)))
    # the decode offers prompt + answer up to its last boundary: 288 of 299 computed tokens
    _wait("the decode's offer announced", lambda: _kv(g)[stack.d.url]["host_entries"] >= 1)
    body = _body([*p1, *turn1, *_prompt(7, 30)], 16)
    want = _tokens(_complete(stack.a.url, body))  # a plain engine, nothing of it cached
    pulled = _pulled(stack.b)
    got = _complete(g.url, body)
    assert _tokens(got) == want
    # the prefill engine had turn 1's prompt (192 tokens up to its last boundary); the 96
    # tokens of the answer's blocks came from the decode's sidecar
    _wait("the prefill counts the pull", lambda: _pulled(stack.b) == pulled + 96, 20)
    loaded = g.metric("dsv4_gateway_prefix_pulls_total", outcome="loaded")
    assert loaded == 1
