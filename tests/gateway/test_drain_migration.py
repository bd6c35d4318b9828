"""Drain by moving the KV: ``POST /drain`` on the decode engine serving 16 streams (greedy and
seeded sampling; MTP on, the tiny model's default) ends each with a migrate block carrying the
export of its KV; the gateway resumes each on the other decode engine, which pulls the KV (every
token but the last) instead of recomputing it. Every client stream (the openai SDK) equals the
uninterrupted run's, token for token; the drained engine runs nothing within 5 s. Streams under
a grammar (json_schema, tool_calls) move too. Then the same engines take a kill -9 (the
recompute path). Real engines (dsv4-tiny), KV sidecars and a gateway on 127.0.0.1, shared by
the cases (a drained engine is re-admitted with ``DELETE /drain``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import httpx
import openai
import pytest

from dsv4_common.process import Service, metric_value
from dsv4_kvtransfer.launch import SidecarService
from dsv4_serving.chat.tool_ids import derived_tool_call_id
from tests.gateway.conftest import gateway, pd_pair, running
from tests.structured_requests import NO_THINKING, TOOLS, WEATHER

MODEL = "dsv4-tiny"
STREAMS = 16
MAX_TOKENS = 220
MOVE_AFTER = 12  # chunks every stream has before the drain (or the kill)


class Stack(NamedTuple):
    gateway: Service
    prefill: Service
    decodes: tuple[Service, Service]
    sidecars: dict[str, SidecarService]  # each decode engine's, by the engine's url


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    token = tmp_path_factory.mktemp("kv") / "kv-token"
    token.write_text("drain-migration-test-token")
    (ps, pe), (d0s, d0), (d1s, d1) = (
        pd_pair("mig-p", "prefill", token),
        pd_pair("mig-d0", "decode", token),
        pd_pair("mig-d1", "decode", token),
    )
    # each migration is logged at info: the log says what a failed drain did
    gw = gateway(
        "gateway-mig",
        *("--log-level", "info", "--prefill", pe.url, "--decode", d0.url, "--decode", d1.url),
    )
    with running(ps, pe, d0s, d0, d1s, d1, timeout_s=900), running(gw) as (g,):
        yield Stack(g, pe, (d0, d1), {d0.url: d0s, d1.url: d1s})


def _prompt(i: int) -> str:
    return f"Stream {i}: the quick brown fox jumps over the lazy dog, and then"


def _stream(url: str, i: int, progress: Callable[[int], None] | None = None) -> list[int]:
    """Stream ``i``'s token ids as the client got them (EOS ignored): greedy for even ``i``,
    sampled with seed ``i`` for odd ones (MTP verification draws by position)."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    chunks = c.completions.create(
        model=MODEL,
        prompt=_prompt(i),
        max_tokens=MAX_TOKENS,
        temperature=0 if i % 2 == 0 else 0.8,
        seed=i,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids: list[int] = []
    finish = None
    for k, ch in enumerate(chunks):
        for choice in ch.choices:
            ids += (choice.model_extra or {}).get("token_ids") or []
            finish = choice.finish_reason or finish
        if progress is not None:
            progress(k)
    assert finish == "length"
    return ids


def _all_streams(url: str, at_cut: Callable[[], None] | None = None) -> list[list[int]]:
    """The 16 streams at once; ``at_cut`` runs once every stream has ``MOVE_AFTER`` chunks."""
    reached = threading.Semaphore(0)

    def progress(k: int) -> None:
        if k == MOVE_AFTER:
            reached.release()

    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [
            pool.submit(_stream, url, i, progress if at_cut else None) for i in range(STREAMS)
        ]
        if at_cut is not None:
            for _ in range(STREAMS):
                assert reached.acquire(timeout=600)
            at_cut()
        return [f.result() for f in futures]


@pytest.fixture(scope="module")
def uninterrupted(stack: Stack) -> list[list[int]]:
    return _all_streams(stack.gateway.url)


def _busiest(g: Service, decodes: tuple[Service, ...]) -> Service:
    load = {
        i["url"]: i["inflight_requests"] for i in httpx.get(f"{g.url}/instances", timeout=5).json()
    }
    return max(decodes, key=lambda d: load.get(d.url, 0))


def _running(e: Service) -> float:
    return e.metric("vllm:num_requests_running")


def _transfers(e: Service, direction: str) -> float:
    return e.metric("dsv4_kv_engine_transfers_total", direction=direction, outcome="ok")


def _active_exports(s: SidecarService) -> float:
    """Exports ``s`` holds now (the gauge an operator's drain waits on to reach 0)."""
    text = httpx.get(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=5).text
    return metric_value(text, "dsv4_kv_active_exports")


def test_a_drain_moves_every_stream_with_its_kv(
    stack: Stack, uninterrupted: list[list[int]]
) -> None:
    g, (d0, d1) = stack.gateway, stack.decodes
    assert all(len(ids) == MAX_TOKENS for ids in uninterrupted)
    before = {d.url: (_transfers(d, "pull"), _transfers(d, "export")) for d in (d0, d1)}
    prefilled = _transfers(stack.prefill, "export")
    recomputes = {d.url: d.metric("dsv4_kv_recomputes_total") for d in (d0, d1)}
    drained: list[tuple[Service, dict[str, Any], float]] = []

    def drain() -> None:
        victim = _busiest(g, (d0, d1))
        for bad in ({"migrate": "yes"}, {"mode": "migrate"}, [1]):  # refused, nothing drained
            refused = httpx.post(f"{victim.url}/drain", json=bad, timeout=10)
            assert refused.status_code == 400, refused.text
        assert httpx.get(f"{victim.url}/ready", timeout=5).status_code == 200
        answer = httpx.post(f"{victim.url}/drain", json={}, timeout=10)
        assert answer.status_code == 200, answer.text
        drained.append((victim, answer.json(), time.monotonic()))

    got = _all_streams(g.url, drain)
    assert got == uninterrupted  # every stream, token for token
    ((victim, answer, t0),) = drained
    peer = d1 if victim is d0 else d0
    moved = answer["migrating"]
    # the busiest engine holds >= 8 of the 16 in the gateway's count; a stream still in its
    # prefill there is not movable yet (a second call moves it), hence not all of them
    assert moved >= STREAMS // 4 and answer["kv"] is True, answer
    # the victim is idle within the transfer time, not the longest generation
    while _running(victim) and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert _running(victim) == 0
    assert httpx.get(f"{victim.url}/ready", timeout=5).status_code == 503
    # and its sidecar holds no export within 5 s of the drain: the peer released each moved
    # stream's export once it had the KV (not the 30 s lease)
    sidecar = stack.sidecars[victim.url]
    while _active_exports(sidecar) and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert _active_exports(sidecar) == 0, (
        f"{victim.name}'s sidecar still holds moved exports\n{g.tail(80)}\n{peer.tail(40)}"
    )
    # each moved stream's KV went out of the victim and into the peer, and nothing was
    # recomputed after a failed pull
    assert _transfers(victim, "export") - before[victim.url][1] == moved
    assert _transfers(peer, "pull") - before[peer.url][0] >= moved
    assert peer.metric("dsv4_kv_recomputes_total") == recomputes[peer.url]
    # ... nor by a new prefill (a continuation without the KV is a PD request of its own)
    assert _transfers(stack.prefill, "export") - prefilled == STREAMS
    assert g.metric("dsv4_gateway_stream_migrations_total", reason="drain") == moved
    assert g.metric("dsv4_gateway_stream_migrations_total", outcome="failed") == 0
    # re-admitted: the engine admits again, the gateway routes to it again
    assert httpx.delete(f"{victim.url}/drain", timeout=5).status_code == 200
    assert httpx.get(f"{victim.url}/ready", timeout=5).status_code == 200


def _structured(url: str, kind: str, progress: Callable[[int], None] | None = None) -> Any:
    """A greedy chat stream under a grammar (a json_schema, or tool_choice required): what the
    client got, token ids, content and each tool-call delta (ids included)."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    grammar: dict[str, Any] = (
        {"tools": TOOLS, "tool_choice": "required"}
        if kind == "tools"
        else {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
            }
        }
    )
    chunks = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Weather in Paris, please ({kind})."}],
        max_tokens=160,
        temperature=0,
        stream=True,
        extra_body={**NO_THINKING, "return_token_ids": True},
        **grammar,
    )
    ids: list[int] = []
    seen: list[Any] = []
    answer_ids: set[str] = set()
    for ch in chunks:
        answer_ids.add(ch.id)
        for choice in ch.choices:
            ids += (choice.model_extra or {}).get("token_ids") or []
            d = choice.delta
            calls = [
                (t.index, t.id, t.function.name, t.function.arguments)
                for t in d.tool_calls or []
                if t.function is not None
            ]
            for index, call_id, _, _ in calls:  # one answer, its call ids derived from it
                assert call_id in (None, derived_tool_call_id(ch.id, 0, index))
            seen.append((d.content, calls, choice.finish_reason))
        if progress is not None:
            progress(len(ids))  # tokens, not chunks: a client behind gets several per chunk
    assert len(answer_ids) == 1
    return ids, seen


def _once_at(n: int, call: Callable[[], None]) -> Callable[[int], None]:
    """A progress callback that calls ``call`` once, when ``n`` tokens have arrived."""
    done = False

    def progress(tokens: int) -> None:
        nonlocal done
        if tokens >= n and not done:
            done = True
            call()

    return progress


def _same_answer(seen: list[Any]) -> tuple[str, dict[int, tuple[bool, str, str]], list[str]]:
    """What the client assembles from the deltas: the content, each tool call (whether it got
    an id, checked against the answer's above; its name; its arguments) and the finish
    reasons. How text is cut into deltas is not compared: a client that falls behind gets
    several tokens in one delta (coalesced increments), so the cut depends on timing."""
    content = "".join(c for c, _, _ in seen if c)
    calls: dict[int, tuple[bool, str, str]] = {}
    for _, deltas, _ in seen:
        for index, call_id, name, args in deltas:
            had_id, had_name, had_args = calls.get(index, (False, "", ""))
            calls[index] = (
                had_id or call_id is not None,
                had_name + (name or ""),
                had_args + (args or ""),
            )
    return content, calls, [f for _, _, f in seen if f]


def test_streams_under_a_grammar_move_and_stay_identical(stack: Stack) -> None:
    """A json_schema stream, then a tool_calls stream: at its 8th token the engine serving it
    is drained (and re-admitted after); each stream moves and equals the uninterrupted one,
    tool-call ids included. One at a time: a grammar's answer lasts about a second here, less
    than the gateway takes to re-admit a drained engine."""
    g, decodes = stack.gateway, stack.decodes
    for kind in ("json", "tools"):
        want_ids, want_seen = _structured(g.url, kind)
        if kind == "tools":
            assert any(calls for _, calls, _ in want_seen), "no tool call streamed"
        moves = g.metric("dsv4_gateway_stream_migrations_total", reason="drain")
        reached = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(_structured, g.url, kind, _once_at(8, reached.set))
            assert reached.wait(timeout=600)
            victim = _busiest(g, decodes)
            try:
                answer = httpx.post(f"{victim.url}/drain", timeout=10)
                assert answer.status_code == 200 and answer.json()["migrating"] == 1, answer.text
                ids, seen = future.result()
            finally:  # re-admitted even after a failure: the next tests share these engines
                readmitted = httpx.delete(f"{victim.url}/drain", timeout=5).status_code
        assert readmitted == 200
        _routable(g, decodes)
        assert ids == want_ids, kind
        assert _same_answer(seen) == _same_answer(want_seen), kind
        assert g.metric("dsv4_gateway_stream_migrations_total", reason="drain") == moves + 1
    assert g.metric("dsv4_gateway_stream_migrations_total", outcome="failed") == 0


def _routable(g: Service, engines: tuple[Service, ...]) -> None:
    """Until the gateway routes to every one of ``engines`` (its health check re-admitted)."""
    urls = {e.url for e in engines}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ok = {
            i["url"]
            for i in httpx.get(f"{g.url}/instances", timeout=5).json()
            if i["healthy"] and not i["draining"]
        }
        if urls <= ok:
            return
        time.sleep(0.2)
    raise AssertionError(f"the gateway does not route to {urls - ok}")


def test_a_killed_decode_engine_s_streams_are_recomputed_exactly(
    stack: Stack, uninterrupted: list[list[int]]
) -> None:
    """The victim is started again by the next test."""
    g, (d0, d1) = stack.gateway, stack.decodes
    _routable(g, (d0, d1))

    def kill() -> None:
        victim = _busiest(g, (d0, d1))
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)

    assert _all_streams(g.url, kill) == uninterrupted
    assert g.metric("dsv4_gateway_stream_migrations_total", reason="broken", outcome="failed") == 0


def test_sigterm_on_an_engine_with_a_kv_sidecar_moves_its_streams(
    stack: Stack, uninterrupted: list[list[int]]
) -> None:
    """Last: SIGTERM (to the leader only, as Kubernetes sends it) moves the streams with their
    KV before the engine exits (0); the engine killed above is started again first (its
    sidecar lived on)."""
    g, (d0, d1) = stack.gateway, stack.decodes
    for d in (d0, d1):
        if not d.running():
            d.start(env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
            d.wait_ready(600)
    _routable(g, (d0, d1))
    moves = g.metric("dsv4_gateway_stream_migrations_total", reason="drain", outcome="continued")
    victims: list[Service] = []

    def term() -> None:
        victims.append(_busiest(g, (d0, d1)))
        assert victims[0].pid is not None
        os.kill(victims[0].pid, signal.SIGTERM)

    assert _all_streams(g.url, term) == uninterrupted
    (victim,) = victims
    deadline = time.monotonic() + 60
    while victim.running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert victim.exit_code() == 0
    after = g.metric("dsv4_gateway_stream_migrations_total", reason="drain", outcome="continued")
    assert after - moves >= STREAMS // 2, f"{g.tail(80)}\n{victim.tail(40)}"
    assert g.metric("dsv4_gateway_stream_migrations_total", outcome="failed") == 0
