"""Pulled KV that fails its integrity check is never used, real processes on 127.0.0.1: a byte of
an export changed in the prefill sidecar's staging region after its commit, and a decode engine
of another ``--revision``, each make the decode engine recompute the prompt (counted by reason)
and answer the ``both`` engine's greedy tokens.

  both     both, with sidecar sp: the prefill of every PD request, and the local reference
  decode   decode, sidecar sd pulling over shm (the engine's client copies, else sd in place)
  other    decode with --revision other, sidecar so pulling over tcp
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_kvtransfer.pd_protocol import decode_request, prefill_request
from dsv4_kvtransfer.staging import StagingRegion
from tests.engine.common import workload
from tests.pd.engines import EngineProc, start_engine
from tests.pd.sidecars import SHM_DIR, SidecarFactory, SidecarProc

pytestmark = pytest.mark.pd

TINY = ["--model", "dsv4-tiny", "--num-speculative-tokens", "1"]
FAILURES = "dsv4_kv_pull_failures_total"


@dataclass
class Stack:
    both: EngineProc
    decode: EngineProc
    other: EngineProc
    sd: SidecarProc
    so: SidecarProc


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("pd-integrity")
    f = SidecarFactory(tmp, f"g{int(time.time() * 1000) % 10**8}")
    engines: list[EngineProc] = []
    try:
        sp = f.start(staging="48M")
        sd = f.start("--transport", "shm", staging="48M")
        so = f.start(staging="48M")
        for name, sc, args in (
            ("both", sp, ("--role", "both")),
            ("decode", sd, ("--role", "decode")),
            ("other", so, ("--role", "decode", "--revision", "other")),
        ):
            engines.append(start_engine(name, tmp, *TINY, *args, "--kv-sidecar", sc.control_url))
        for e in engines:
            e.wait_ready()
        yield Stack(*engines, sd, so)
    except BaseException:
        for e in engines:
            print(f"--- engine {e.name} ---\n{e.tail()}")
        print(f.failure_report())
        raise
    finally:
        for e in engines:
            e.stop()
        f.close()


def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": "dsv4-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def completion(url: str, b: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", json=b, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def flip_a_byte(prefill_answer: dict[str, Any], at: int) -> None:
    """Change one byte of the export in the prefill sidecar's staging region."""
    src = prefill_answer["kv_transfer_params"]["remote_shm"]
    region = StagingRegion.attach(src["name"], SHM_DIR)
    try:
        assert region.tag_hex == src["tag"]
        with region.view(src["offset"] + at, 1) as v:
            v[0] ^= 0x10
    finally:
        region.close()


def test_a_byte_changed_in_the_prefill_staging_is_recomputed_exactly(stack: Stack) -> None:
    s = stack
    items = workload(3, 6, shared_prefix=0)
    n0 = s.decode.metric(FAILURES, reason="checksum_mismatch")
    r0 = s.decode.metric("dsv4_kv_recomputes_total")
    for i, (prompt, max_tokens) in enumerate(items):
        b = body(prompt, max_tokens)
        want = tokens(completion(s.both.url, b))
        p = completion(s.both.url, prefill_request(b))
        if i == 1:  # (the first pull left a grant: the client copies this one first)
            flip_a_byte(p, 0)  # the first buffer starts there
        assert tokens(completion(s.decode.url, decode_request(b, p))) == want
    assert s.decode.metric(FAILURES, reason="checksum_mismatch") == n0 + 1
    assert s.decode.metric("dsv4_kv_recomputes_total") == r0 + 1
    assert s.sd.metric(FAILURES, reason="checksum_mismatch") >= 1
    assert s.decode.metric("dsv4_kv_engine_transfers_total", direction="pull", outcome="ok") >= 2


def test_a_decode_of_another_revision_recomputes_exactly(stack: Stack) -> None:
    s = stack
    prompt, max_tokens = workload(1, 8, shared_prefix=0)[0]
    b = body(prompt, max_tokens)
    want = tokens(completion(s.both.url, b))
    n0 = s.other.metric(FAILURES, reason="fingerprint_mismatch")
    r0 = s.other.metric("dsv4_kv_recomputes_total")
    received0 = s.so.metric("dsv4_kv_transfer_bytes_total", direction="received")
    p = completion(s.both.url, prefill_request(b))
    assert tokens(completion(s.other.url, decode_request(b, p))) == want
    assert s.other.metric(FAILURES, reason="fingerprint_mismatch") == n0 + 1
    assert s.other.metric("dsv4_kv_recomputes_total") == r0 + 1
    # refused on its manifest: not a byte of KV came over
    assert s.so.metric("dsv4_kv_transfer_bytes_total", direction="received") == received0
