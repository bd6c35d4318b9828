"""Precise prefix routing with two real engines publishing KV events: a repeated prefix goes to
the engine holding it, the gateway's predicted cached tokens equal what the engine reports,
and after that engine evicts the prefix (a small KV pool) the index forgets it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsv4_common.process import Service, free_ports
from tests.gateway.conftest import engine, gateway, routed_counts, running

BS = 32  # not the gateway's default (16): it learns the engines' from their events
SMALL = ("--block-size", str(BS), "--num-kv-blocks", "12", "--max-model-len", "128")


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Service, Service, Service]]:
    taken: set[int] = set()  # PUB on PORT, replay on PORT + 1: both free, no overlap
    ep = [f"tcp://127.0.0.1:{free_ports(2, taken)}" for _ in range(2)]
    a = engine("pp-a", *SMALL, "--kv-events-endpoint", ep[0])
    b = engine("pp-b", *SMALL, "--kv-events-endpoint", ep[1])
    # engines may wait minutes for a kernel build other processes hold the lock of
    with running(a, b, timeout_s=600):
        flags = ("--engine", a.url, "--engine", b.url)
        flags += ("--kv-events", f"{a.url}={ep[0]}", "--kv-events", f"{b.url}={ep[1]}")
        with running(gateway("pp-gw", *flags)) as (g,):
            yield a, b, g


def _kv(g: Service) -> dict[str, dict[str, Any]]:
    rows = httpx.get(f"{g.url}/instances", timeout=10).json()
    return {r["url"]: r["kv_events"]["ranks"][0] for r in rows}


def _wait(what: str, cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _settled(g: Service, url: str) -> None:
    """The gateway applied everything the engine published (its sequence stopped moving)."""
    last = None
    for _ in range(100):
        now = _kv(g)[url]["next_seq"]
        if now == last:
            return
        last = now
        time.sleep(0.5)
    raise AssertionError("KV events never settled")


def _predicted(g: Service) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(g.metrics_text())
        for s in f.samples
        if s.name == "dsv4_gateway_predicted_cached_tokens_total"
    )


def _complete(url: str, prompt: list[int]) -> int:
    """Cached prompt tokens the engine reports for ``prompt``."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model="dsv4-tiny", prompt=prompt, max_tokens=1, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


def _routed_once(g: Service, prompt: list[int]) -> tuple[str, int, float]:
    """(the instance that served ``prompt``, its reported cached tokens, the prediction)."""
    before, predicted = routed_counts(g), _predicted(g)
    cached = _complete(g.url, prompt)
    after = routed_counts(g)
    (url,) = [u for u in after if after[u] != before.get(u, 0.0)]
    return url, cached, _predicted(g) - predicted


def test_repeated_prefix_routes_to_its_holder_until_evicted(stack: tuple[Service, ...]) -> None:
    a, b, g = stack
    _wait("both ranks subscribed", lambda: all(r["next_seq"] for r in _kv(g).values()))
    prefix = [(5 * i + 1) % 200 for i in range(96)]  # 3 blocks
    holder, cached, predicted = _routed_once(g, [*prefix, 1, 2, 3])
    assert (cached, predicted) == (0, 0)
    _settled(g, holder)
    assert _kv(g)[holder]["blocks"] >= 3 and _kv(g)[holder]["block_size"] == BS
    for k in range(3):  # whatever the rotation would say, the holder gets each
        url, cached, predicted = _routed_once(g, [*prefix, 10 + k, 4])
        assert url == holder
        # the engine found exactly what the index predicted (2 blocks: MTP keys the snapshot
        # at 96 by the token after it, which differs here)
        assert cached == predicted == 2 * BS
        _settled(g, holder)

    # the holder's small pool is refilled behind the gateway's back: the prefix is evicted
    for k in range(6):
        _complete(holder, [(11 * i + 7 * k + 3) % 200 for i in range(100)])
    _settled(g, holder)
    url, cached, predicted = _routed_once(g, [*prefix, 20, 4])
    assert (cached, predicted) == (0, 0)
    assert all(r["lossy_resyncs"] == 0 for r in _kv(g).values())
    del a, b, url
