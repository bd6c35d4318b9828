"""Prefix pulls from a sidecar's host tier, real engines and sidecars on 127.0.0.1 (dsv4-tiny,
block size 16, no MTP): a finished request's deepest snapshotted prefix is offered to its
engine's sidecar; another engine (same role, or a PD prefill for turn 2 of a session whose
turn 1 was decoded elsewhere) pulls it instead of computing it, computes only the rest, and
its greedy tokens equal a plain engine's; the engine that offered it gets it back from its own
sidecar once its device cache evicted it.

Engines: ``ref`` (both, no sidecar: the oracle), ``a`` (both, a small KV pool), ``b`` (both:
same-role puller, and the PD prefill), ``d`` (decode); every sidecar keeps a host tier.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from dsv4_common.kv_events import snapshot_hash
from dsv4_kvtransfer.pd_protocol import (
    PREFIX_PULL,
    PrefixPullParams,
    decode_request,
    prefill_request,
)
from dsv4_serving.engine.request import EngineCoreRequest, Request
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from tests.helpers import wait_for
from tests.pd.engines import EngineProc, start_engine
from tests.pd.sidecars import SidecarFactory, SidecarProc

BS = 16  # dsv4-tiny's block size (the lcm of its compression ratios, at least 16)
TINY = ["--model", "dsv4-tiny", "--num-speculative-tokens", "0"]
# ``a`` schedules in turn, ``b`` and ``d`` ahead (async): a decode snapshots the boundaries it
# passes either way, so both offer their answers (see docs/cluster-kv.md)
SYNC = ["--async-scheduling", "off"]
ASYNC = ["--async-scheduling", "on"]
HOST_TIER = ("--kv-host-bytes", "24M")


@dataclass
class Stack:
    ref: EngineProc
    a: EngineProc
    b: EngineProc
    d: EngineProc
    sa: SidecarProc
    sb: SidecarProc
    sd: SidecarProc


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prefix-pull")
    f = SidecarFactory(tmp, f"x{int(time.time() * 1000) % 10**8}")
    engines: list[EngineProc] = []
    try:
        sa, sb, sd = (f.start(*HOST_TIER, staging="48M") for _ in range(3))

        def eng(name: str, *args: str) -> EngineProc:
            engines.append(start_engine(name, tmp, *TINY, *args))
            return engines[-1]

        ref = eng("ref")
        # 48 blocks: three 400-token prompts evict a finished session's blocks
        a = eng(
            "a", *SYNC, "--role", "both", "--kv-sidecar", sa.control_url, "--num-kv-blocks", "48"
        )
        b = eng("b", *ASYNC, "--role", "both", "--kv-sidecar", sb.control_url)
        d = eng("d", *ASYNC, "--role", "decode", "--kv-sidecar", sd.control_url)
        for e in engines:
            e.wait_ready(600)  # a cold kernel build on a busy host
        yield Stack(ref, a, b, d, sa, sb, sd)
    except BaseException:
        for e in engines:
            print(f"--- engine {e.name} ---\n{e.tail()}")
        print(f.failure_report())
        raise
    finally:
        for e in engines:
            e.stop()
        f.close()


def body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "dsv4-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def complete(e: EngineProc, b: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(e.url + "/v1/completions", json=b, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 250 + 3 for i in range(n)]  # vocabulary: 264


def offered(sc: SidecarProc, seq: list[int]) -> PrefixPullParams:
    """The prefix an engine offers for finished ``seq`` (its computed tokens: all but the last
    sampled one): the deepest block boundary (each one had its snapshot on the way), once the
    sidecar holds it."""
    r = Request(EngineCoreRequest("k", seq, SamplingParams()), 0)
    n = (len(seq) - 1) // BS
    key = snapshot_hash(r.update_block_hashes(BS)[n - 1]).hex()
    pull = PrefixPullParams("127.0.0.1", sc.port, n * BS, key)
    url = f"{sc.control_url}/v1/exports/{pull.transfer_id}"
    wait_for(f"{sc.name} holds the offer", lambda: httpx.get(url).status_code == 200, 20)
    return pull


def pulled(e: EngineProc) -> float:
    return e.metric("dsv4_kv_prefix_tokens_total", outcome="pulled")


def wait_pulled(e: EngineProc, want: float) -> None:
    """The engine's counters follow its steps' stats (a step after the answer at most)."""
    wait_for(f"{e.name} counts {want:g} pulled tokens", lambda: pulled(e) == want, 10, 0.1)


def test_an_idle_engine_pulls_a_session_prefix_and_computes_only_the_rest(stack: Stack) -> None:
    p1 = prompt(1, 200)
    turn1 = tokens(complete(stack.a, body(p1, 24)))
    seq = [*p1, *turn1]
    pull = offered(stack.sa, seq)
    assert pull.num_tokens == 208
    turn2 = [*seq, *prompt(2, 30)]
    want = tokens(complete(stack.ref, body(turn2, 16)))
    before = pulled(stack.b)
    got = complete(stack.b, body(turn2, 16, kv_transfer_params={PREFIX_PULL: pull.to_dict()}))
    assert tokens(got) == want
    # b computed only the 46 tokens after the prefix: the 208 before came from a's sidecar
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 208
    wait_pulled(stack.b, before + 208)
    assert stack.b.metric("dsv4_kv_prefix_tokens_total", outcome="recomputed") == 0
    # a pull of a prefix nobody holds is computed instead, counted, and just as exact
    gone = PrefixPullParams("127.0.0.1", stack.sa.port, 208, "0" * 64)
    other = [*seq, *prompt(3, 30)]
    got = complete(stack.b, body(other, 16, kv_transfer_params={PREFIX_PULL: gone.to_dict()}))
    assert tokens(got) == tokens(complete(stack.ref, body(other, 16)))


def test_the_host_tier_serves_a_prefix_back_after_the_device_cache_evicted_it(
    stack: Stack,
) -> None:
    p1 = prompt(4, 200)
    seq = [*p1, *tokens(complete(stack.a, body(p1, 24)))]
    pull = offered(stack.sa, seq)
    for i in range(3):  # fill a's 48 blocks three times over
        complete(stack.a, body(prompt(10 + i, 400), 1))
    turn2 = [*seq, *prompt(5, 30)]
    want = tokens(complete(stack.ref, body(turn2, 16)))
    before = pulled(stack.a)
    got = complete(stack.a, body(turn2, 16, kv_transfer_params={PREFIX_PULL: pull.to_dict()}))
    assert tokens(got) == want
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 208
    # from its own sidecar, not recomputed
    wait_for("a pulls from its sidecar", lambda: pulled(stack.a) > before, 10, 0.1)


def test_pd_turn_two_pulls_turn_ones_answer_from_the_decode_sidecar(stack: Stack) -> None:
    p1 = prompt(6, 200)
    b1 = body(p1, 24)
    pre = complete(stack.b, prefill_request(b1))
    assert pre["kv_transfer_params"]["dsv4_block_size"] == BS
    turn1 = tokens(complete(stack.d, decode_request(b1, pre)))
    assert turn1 == tokens(complete(stack.ref, b1))
    seq = [*p1, *turn1]
    pull = offered(stack.sd, seq)  # the (async) decode offered prompt + answer
    b2 = body([*seq, *prompt(7, 30)], 16)
    params = {**prefill_request(b2)["kv_transfer_params"], PREFIX_PULL: pull.to_dict()}
    before = pulled(stack.b)
    pre = complete(stack.b, {**prefill_request(b2), "kv_transfer_params": params})
    # b had turn 1's prompt (192 tokens up to its last boundary); the answer's blocks came
    # from d's sidecar: nothing of them was computed again
    assert pre["usage"]["prompt_tokens_details"]["cached_tokens"] == 208
    wait_pulled(stack.b, before + 16)
    assert tokens(complete(stack.d, decode_request(b2, pre))) == tokens(complete(stack.ref, b2))
