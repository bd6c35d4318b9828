"""Same-host PD with the decode sidecar pulling over shm, real processes on 127.0.0.1: the decode
engine's client copies each prompt's KV itself into an extent its sidecar granted it
(``dsv4_kvtransfer.local_pull``) instead of asking the sidecar to; the tokens equal a local
run's, and both sides end as free as they started (the decode region but for the one grant the
decode engine's client keeps for its next pull)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_kvtransfer.control_requests import MAX_GRANT_BYTES
from dsv4_kvtransfer.pd_protocol import decode_request, prefill_request
from tests.engine.common import workload
from tests.helpers import wait_for
from tests.pd.engines import EngineProc, start_engine
from tests.pd.sidecars import SidecarFactory, SidecarProc

TINY = ["--model", "dsv4-tiny", "--num-speculative-tokens", "1"]


@dataclass
class Stack:
    both: EngineProc  # prefill for the PD requests, and the local reference
    decode: EngineProc
    sp: SidecarProc
    sd: SidecarProc  # --transport shm


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("pd-in-place")
    f = SidecarFactory(tmp, f"i{int(time.time() * 1000) % 10**8}")
    engines: list[EngineProc] = []
    try:
        sp = f.start(staging="48M")
        sd = f.start("--transport", "shm", staging="48M")
        for name, role, sc in (("both", "both", sp), ("decode", "decode", sd)):
            engines.append(
                start_engine(name, tmp, *TINY, "--role", role, "--kv-sidecar", sc.control_url)
            )
        for e in engines:
            e.wait_ready()
        yield Stack(engines[0], engines[1], sp, sd)
    except BaseException:
        for e in engines:
            print(f"--- engine {e.name} ---\n{e.tail()}")
        print(f.failure_report())
        raise
    finally:
        for e in engines:
            e.stop()
        f.close()


def completion(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def test_pd_pulls_copied_by_the_decode_engines_client_equal_a_local_run(stack: Stack) -> None:
    s = stack
    items = workload(10, 5)
    for prompt, max_tokens in items:  # one at a time: each pull finds the grant left before
        b = {
            "model": "dsv4-tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        want = tokens(completion(s.both.url, b))
        p = completion(s.both.url, prefill_request(b))
        assert p.status_code == 200, p.text
        assert p.json()["kv_transfer_params"].get("remote_shm"), "no same-host place in the params"
        assert tokens(completion(s.decode.url, decode_request(b, p.json()))) == want
    done = s.sd.metric("dsv4_kv_pulls_total", outcome="done")
    adopted = s.sd.metric("dsv4_kv_pulls_adopted_total")
    # the first pull (and one of each larger size) asks the sidecar, and a grant for the next
    assert done == len(items) and adopted >= len(items) // 2, (done, adopted)
    assert s.decode.metric("dsv4_kv_recomputes_total") == 0
    for e in (s.both, s.decode):
        wait_for(f"{e.name}'s blocks free", lambda e=e: e.free_blocks() == e.total_blocks, 20)
    total = int(s.sp.info()["staging_bytes"])  # type: ignore[call-overload]
    wait_for("the prefill side's staging free", lambda: s.sp.free_bytes() == total, 20)

    def decode_side_free() -> bool:
        info = s.sd.info()
        granted = int(info["granted_bytes"])  # type: ignore[call-overload]
        free = int(info["free_bytes"])  # type: ignore[call-overload]
        return 0 < granted <= MAX_GRANT_BYTES and free + granted == total

    wait_for("the decode side's staging free but for one grant", decode_side_free, 20)
