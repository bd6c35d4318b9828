"""Prefill and decode engines with their KV sidecars, real processes on 127.0.0.1: PD output
equals one engine's in ``both`` mode token for token (greedy; mixed lengths, prompts past the
128-token window, prefix-cache hits, MTP on decode, V3 once), and every failure (prefill sidecar
killed mid-transfer, an expired lease, a wrong token, garbage on the peer port, a client that
leaves, mismatched engines) ends with every block and staging byte free again on both sides.

Engines, in one module-scoped stack (started at once, ~25 s on 2 cores):
  ref  both, dsv4-tiny                       the reference (greedy tokens do not depend on MTP)
  p1/d1  prefill/decode dsv4-tiny, MTP 1, decode policy recompute
  p2/d2  prefill/decode dsv4-tiny, MTP 2, decode policy fail
  b3/d3  both (with a sidecar, acting as prefill) / decode, dsv3-small
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_kvtransfer.pd_protocol import KV_TRANSFER_ERROR_TYPE, decode_request, prefill_request
from tests.engine.common import workload
from tests.helpers import wait_for
from tests.pd.engines import EngineProc, start_engine
from tests.pd.sidecars import SidecarFactory, SidecarProc

TINY = ["--model", "dsv4-tiny"]


@dataclass
class Pair:
    prefill: EngineProc
    decode: EngineProc
    sp: SidecarProc  # the prefill engine's sidecar
    sd: SidecarProc  # the decode engine's sidecar
    model: str


@dataclass
class Stack:
    factory: SidecarFactory
    ref: EngineProc
    k1: Pair
    k2: Pair
    v3: Pair

    def engines(self) -> list[EngineProc]:
        return [self.ref, *(e for p in (self.k1, self.k2, self.v3) for e in (p.prefill, p.decode))]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("pd-engine")
    f = SidecarFactory(tmp, f"e{int(time.time() * 1000) % 10**8}")
    engines: list[EngineProc] = []
    try:
        sc = [f.start(staging="48M") for _ in range(6)]

        def eng(name: str, *args: str) -> EngineProc:
            e = start_engine(name, tmp, *args)
            engines.append(e)
            return e

        def pd(i: int, role: str, *args: str) -> EngineProc:
            return eng(f"{role}-{i}", "--role", role, "--kv-sidecar", sc[i].control_url, *args)

        ref = eng("ref", *TINY, "--num-speculative-tokens", "0")
        k1 = Pair(
            pd(0, "prefill", *TINY, "--num-speculative-tokens", "1"),
            pd(1, "decode", *TINY, "--num-speculative-tokens", "1"),
            sc[0],
            sc[1],
            "dsv4-tiny",
        )
        k2 = Pair(
            pd(2, "prefill", *TINY, "--num-speculative-tokens", "2"),
            pd(
                3,
                "decode",
                *TINY,
                "--num-speculative-tokens",
                "2",
                "--kv-failure-policy",
                "fail",
                "--kv-pull-timeout",
                "10",
            ),
            sc[2],
            sc[3],
            "dsv4-tiny",
        )
        v3 = ["--model", "dsv3-small", "--num-speculative-tokens", "1"]
        b3 = Pair(pd(4, "both", *v3), pd(5, "decode", *v3), sc[4], sc[5], "dsv3-small")
        for e in engines:
            e.wait_ready()
        yield Stack(f, ref, k1, k2, b3)
    except BaseException:
        for e in engines:
            print(f"--- engine {e.name} ---\n{e.tail()}")
        print(f.failure_report())
        raise
    finally:
        for e in engines:
            e.stop()
        f.close()


# ---- helpers -------------------------------------------------------------------------------


def body(model: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def run_pd(
    pair: Pair, b: dict[str, Any], path: str = "/v1/completions", timeout: float = 60.0
) -> httpx.Response:
    """The gateway's two legs: prefill (params verbatim from its answer), then decode."""
    p = httpx.post(pair.prefill.url + path, json=prefill_request(b), timeout=timeout)
    assert p.status_code == 200, p.text
    answer = p.json()
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_transfer_id"]
    assert len(answer["choices"][0]["token_ids"]) == 1  # the first token only
    return httpx.post(pair.decode.url + path, json=decode_request(b, answer), timeout=timeout)


def assert_all_free(engines: list[EngineProc], sidecars: list[SidecarProc]) -> None:
    for e in engines:
        wait_for(f"{e.name}'s blocks free", lambda e=e: e.free_blocks() == e.total_blocks, 20)
    for sc in sidecars:
        total = int(sc.info()["staging_bytes"])  # type: ignore[call-overload]
        wait_for(
            f"sidecar {sc.name}'s staging free",
            lambda sc=sc, total=total: sc.free_bytes() == total,
            20,
        )


def restart(
    stack: Stack,
    pair: Pair,
    which: str,
    *extra: str,
    lease: float = 30.0,
    token_file: Path | None = None,
) -> SidecarProc:
    """Replace a sidecar by a new process on the same control port and region name (the
    engine keeps its URL; its client re-maps the new region)."""
    old: SidecarProc = getattr(pair, which)
    old.kill()
    new = stack.factory.start(
        "--control-port",
        str(old.control_port),
        *extra,
        staging="48M",
        shm_name=old.shm_name,
        lease=lease,
        token_file=token_file,
    )
    setattr(pair, which, new)
    return new


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def wait_pull_started(sp: SidecarProc, prefill_answer: dict[str, Any]) -> None:
    """Until a reader holds the export pinned (bytes are flowing)."""
    tid = prefill_answer["kv_transfer_params"]["remote_transfer_id"]
    wait_for(
        "the decode side's pull to start",
        lambda: sp.client.request("GET", f"/v1/exports/{tid}")["pins"] > 0,
        20,
        0.02,
    )


# ---- PD equals both mode -------------------------------------------------------------------

MIXED = workload(16, 1) + workload(16, 2, shared_prefix=50)  # 32 prompts, 3..243 tokens


def _equal_to_reference(stack: Stack, pair: Pair, items: list[tuple[list[int], int]]) -> None:
    with ThreadPoolExecutor(8) as pool:
        want = list(
            pool.map(
                lambda it: tokens(
                    httpx.post(
                        stack.ref.url + "/v1/completions", json=body("dsv4-tiny", *it), timeout=120
                    )
                ),
                items,
            )
        )
        got: list[list[int]] = []
        half = len(items) // 2  # two waves: the second hits prefixes the first published
        for wave in (items[:half], items[half:]):
            got += pool.map(lambda it: tokens(run_pd(pair, body("dsv4-tiny", *it))), wave)
    bad = [i for i in range(len(items)) if got[i] != want[i]]
    assert not bad, (
        f"{len(bad)} of {len(items)} differ, e.g. #{bad[0]} ({len(items[bad[0]][0])} prompt "
        f"tokens): PD {got[bad[0]]} vs both-mode {want[bad[0]]}"
    )


def test_pd_tokens_equal_both_mode_with_mtp1(stack: Stack) -> None:
    p = stack.k1
    hits0 = p.prefill.metric("vllm:prefix_cache_hits_total")
    assert max(len(x) for x, _ in MIXED) > 128 and min(len(x) for x, _ in MIXED) < 16
    _equal_to_reference(stack, p, MIXED)
    assert p.prefill.metric("vllm:prefix_cache_hits_total") > hits0  # shared prefixes hit
    assert p.decode.metric("dsv4_kv_engine_transfers_total", direction="pull", outcome="ok") >= 32
    assert p.prefill.metric("dsv4_kv_engine_transfers_total", direction="export") >= 32
    assert p.decode.metric("dsv4_kv_recomputes_total") == 0
    assert p.decode.metric("vllm:spec_decode_num_draft_tokens_total") > 0  # MTP ran on decode
    assert_all_free([p.prefill, p.decode], [p.sp, p.sd])


def test_pd_tokens_equal_both_mode_with_mtp2(stack: Stack) -> None:
    p = stack.k2
    _equal_to_reference(stack, p, MIXED[::2])
    assert p.decode.metric("vllm:spec_decode_num_draft_tokens_total") > 0
    assert_all_free([p.prefill, p.decode], [p.sp, p.sd])


def test_pd_chat_with_a_streaming_decode_equals_both_mode(stack: Stack) -> None:
    p = stack.k1
    msgs = [
        {"role": "system", "content": "You are terse. " * 12},
        {"role": "user", "content": "Say something about KV caches."},
    ]
    b = {
        "model": "dsv4-tiny",
        "messages": msgs,
        "max_tokens": 9,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    want = tokens(httpx.post(stack.ref.url + "/v1/chat/completions", json=b, timeout=60))
    pre = httpx.post(p.prefill.url + "/v1/chat/completions", json=prefill_request(b), timeout=60)
    dec = decode_request({**b, "stream": True}, pre.json())
    got: list[int] = []
    with httpx.stream("POST", p.decode.url + "/v1/chat/completions", json=dec, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    got += ch.get("token_ids") or []
    assert got == want
    assert_all_free([p.prefill, p.decode], [p.sp, p.sd])


def test_pd_on_dsv3_equals_both_mode(stack: Stack) -> None:
    p = stack.v3  # its prefill engine runs in both mode: reference and prefill at once
    items = workload(8, 3)
    want = [
        tokens(
            httpx.post(p.prefill.url + "/v1/completions", json=body("dsv3-small", *it), timeout=120)
        )
        for it in items
    ]
    got = [tokens(run_pd(p, body("dsv3-small", *it), timeout=120)) for it in items]
    assert got == want
    assert_all_free([p.prefill, p.decode], [p.sp, p.sd])


# ---- refusals ------------------------------------------------------------------------------


def test_mismatched_engines_and_prompts_are_refused_before_any_pull(stack: Stack) -> None:
    restart(stack, stack.k1, "sp", lease=2.0)  # the refused export goes with its lease
    b = body("dsv4-tiny", list(range(40)), 4)
    pre = httpx.post(stack.k1.prefill.url + "/v1/completions", json=prefill_request(b), timeout=60)
    # a decode engine with another MTP lookahead (ring length) must not take this KV
    r = httpx.post(
        stack.k2.decode.url + "/v1/completions", json=decode_request(b, pre.json()), timeout=60
    )
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == (KV_TRANSFER_ERROR_TYPE, "incompatible")
    assert "num_speculative_tokens" in err["message"]
    # another prompt than the one the prefill computed
    other = body("dsv4-tiny", list(range(1, 41)), 4)
    r = httpx.post(
        stack.k1.decode.url + "/v1/completions", json=decode_request(other, pre.json()), timeout=60
    )
    assert r.status_code == 400 and "another prompt" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "kv_prompt_mismatch"
    # roles: a prefill engine takes no decodes, a decode engine no prefills
    r = httpx.post(
        stack.k1.prefill.url + "/v1/completions", json=decode_request(b, pre.json()), timeout=60
    )
    assert r.status_code == 400 and "prefill engine" in r.json()["error"]["message"]
    r = httpx.post(stack.k1.decode.url + "/v1/completions", json=prefill_request(b), timeout=60)
    assert r.status_code == 400 and "decode engine" in r.json()["error"]["message"]
    # the engines hold nothing; the unpulled export is freed by its lease
    assert_all_free(
        [stack.k1.prefill, stack.k1.decode, stack.k2.decode],
        [stack.k1.sp, stack.k1.sd, stack.k2.sd],
    )
    restart(stack, stack.k1, "sp")


# ---- failures ------------------------------------------------------------------------------

# the prefill sidecar sends in 16 KiB frames at 128 KiB/s: a 250-token prompt's ~0.5 MB of KV
# (mostly the state slot) takes ~4 s, so a kill or a client leaving lands mid-transfer
SLOW = ("--send-rate", "128K", "--max-frame-bytes", "16K")
LONG = [(7 * i + 3) % 256 for i in range(250)]  # past the 128-token window


def test_prefill_sidecar_killed_mid_transfer_recomputes_the_same_tokens(stack: Stack) -> None:
    p = stack.k1
    b = body("dsv4-tiny", LONG, 6)
    want = tokens(httpx.post(stack.ref.url + "/v1/completions", json=b, timeout=60))
    restart(stack, p, "sp", *SLOW)  # a pull now takes seconds
    pre = httpx.post(p.prefill.url + "/v1/completions", json=prefill_request(b), timeout=60)
    t, out = in_thread(
        lambda: httpx.post(
            p.decode.url + "/v1/completions", json=decode_request(b, pre.json()), timeout=60
        )
    )
    wait_pull_started(p.sp, pre.json())
    time.sleep(0.3)
    p.sp.kill()
    t.join(60)
    assert tokens(out["value"]) == want  # policy recompute: prefilled on the decode engine
    assert p.decode.metric("dsv4_kv_recomputes_total") >= 1
    restart(stack, p, "sp")
    assert_all_free([p.prefill, p.decode], [p.sp, p.sd])


def test_prefill_sidecar_killed_mid_transfer_fails_clearly_under_policy_fail(
    stack: Stack,
) -> None:
    p = stack.k2
    b = body("dsv4-tiny", LONG, 6)
    restart(stack, p, "sp", *SLOW)
    pre = httpx.post(p.prefill.url + "/v1/completions", json=prefill_request(b), timeout=60)
    t, out = in_thread(
        lambda: httpx.post(
            p.decode.url + "/v1/completions", json=decode_request(b, pre.json()), timeout=60
        )
    )
    wait_pull_started(p.sp, pre.json())
    time.sleep(0.3)
    p.sp.kill()
    t.join(60)
    r = out["value"]
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == (KV_TRANSFER_ERROR_TYPE, "kv_transfer_params")
    assert err["code"] and f"KV transfer failed (reason={err['code']})" in err["message"]
    assert p.decode.metric("dsv4_kv_pull_failures_total") >= 1
    assert p.decode.metric("dsv4_kv_recomputes_total") == 0
    restart(stack, p, "sp")
    assert_all_free([p.prefill, p.decode], [p.sp, p.sd])


def test_an_expired_lease_recomputes_and_frees_both_sides(stack: Stack) -> None:
    p = stack.k1
    b = body("dsv4-tiny", LONG[:150], 5)
    want = tokens(httpx.post(stack.ref.url + "/v1/completions", json=b, timeout=60))
    restart(stack, p, "sp", lease=1.0)
    pre = httpx.post(p.prefill.url + "/v1/completions", json=prefill_request(b), timeout=60)
    # the decode comes too late: the prefill side already let the export go
    wait_for(
        "the export's lease to run out",
        lambda: p.sp.metric("dsv4_kv_lease_expiries_total", kind="export") >= 1,
        10,
    )
    n0 = p.decode.metric("dsv4_kv_pull_failures_total", reason="unknown_transfer")
    r = httpx.post(p.decode.url + "/v1/completions", json=decode_request(b, pre.json()), timeout=60)
    assert tokens(r) == want
    assert p.decode.metric("dsv4_kv_pull_failures_total", reason="unknown_transfer") == n0 + 1
    # a decode that never comes: the prefill engine's blocks were free at once, its staging
    # extent goes with the lease
    httpx.post(p.prefill.url + "/v1/completions", json=prefill_request(b), timeout=60)
    assert_all_free([p.prefill, p.decode], [p.sp, p.sd])
    restart(stack, p, "sp")


def test_a_wrong_token_between_sidecars_fails_the_pull_not_the_request(stack: Stack) -> None:
    p = stack.k1
    b = body("dsv4-tiny", LONG[:90], 5)
    want = tokens(httpx.post(stack.ref.url + "/v1/completions", json=b, timeout=60))
    restart(stack, p, "sp", lease=2.0)  # the export nobody could pull goes with its lease
    restart(stack, p, "sd", token_file=stack.factory.token("not-the-shared-secret-0123456789"))
    n0 = p.decode.metric("dsv4_kv_pull_failures_total", reason="auth")
    assert tokens(run_pd(p, b)) == want
    assert p.decode.metric("dsv4_kv_pull_failures_total", reason="auth") == n0 + 1
    restart(stack, p, "sd")
    assert_all_free([p.prefill, p.decode], [p.sp, p.sd])
    restart(stack, p, "sp")


def test_garbage_on_the_sidecar_port_is_refused_and_pd_goes_on(stack: Stack) -> None:
    p = stack.k1
    for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 8):
        with socket.create_connection(("127.0.0.1", p.sp.port), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
    wait_for(
        "garbage counted as refused frames",
        lambda: p.sp.metric("dsv4_kv_frames_rejected_total", reason="bad_magic") >= 2,
        5,
        0.05,
    )
    assert p.sp.alive()
    b = body("dsv4-tiny", LONG[:60], 4)
    want = tokens(httpx.post(stack.ref.url + "/v1/completions", json=b, timeout=60))
    assert tokens(run_pd(p, b)) == want
    assert_all_free([p.prefill, p.decode], [p.sp, p.sd])


def test_a_client_leaving_during_the_pull_frees_both_sides(stack: Stack) -> None:
    p = stack.k1
    b = body("dsv4-tiny", LONG, 6)
    restart(stack, p, "sp", *SLOW, lease=3.0)
    pre = httpx.post(p.prefill.url + "/v1/completions", json=prefill_request(b), timeout=60)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            p.decode.url + "/v1/completions",
            json=decode_request(b, pre.json()),
            timeout=httpx.Timeout(60, read=0.8),
        )
    assert_all_free([p.prefill, p.decode], [p.sd, p.sp])
    assert p.decode.metric("dsv4_requests_aborted_total") >= 1
    restart(stack, p, "sp")
