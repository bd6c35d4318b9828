"""PD with parallel engines, real processes on 127.0.0.1: KV exported by a TP or DP instance
and imported by one of another shape gives the single-process ``both`` engine's greedy tokens.

  ref    both, dsv4-tiny, one process              the reference
  tp2    both, TP 2, with a sidecar                prefill for tp1, decode for tp1's prefills
  tp1    both, TP 1, with a sidecar                the other side of each
  pdp2   prefill, DP 2 (EP 2), with a sidecar
  ddp2   decode, DP 2 (EP 2), with a sidecar

A TP instance's cache is replicated over its TP ranks: rank 0 (the core) exports its own and
copies each import to the followers (``kv_connector/tp_replicate.py``). A DP instance runs one
connector per DP rank on the pod's one sidecar: the KV is named by its transfer id, not by the
rank, so a decode on DP rank 0 pulls what prefill DP rank 1 exported (requests pinned by the
``X-data-parallel-rank`` header).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from dsv4_kvtransfer.pd_protocol import decode_request, prefill_request
from tests.engine.common import workload
from tests.pd.engines import EngineProc, start_engine
from tests.pd.sidecars import SidecarFactory, SidecarProc
from tests.pd.test_pd_engine import assert_all_free, body, tokens

pytestmark = pytest.mark.pd

TINY = ["--model", "dsv4-tiny", "--num-speculative-tokens", "1", "--threads-per-rank", "1"]
ITEMS = workload(6, 4, shared_prefix=20)  # prompts of 23..214 tokens (past the window)
RANK = "X-data-parallel-rank"


@dataclass
class Parallel:
    ref: EngineProc
    tp2: EngineProc
    tp1: EngineProc
    pdp2: EngineProc
    ddp2: EngineProc
    sidecars: dict[str, SidecarProc]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parallel]:
    tmp = tmp_path_factory.mktemp("pd-parallel")
    f = SidecarFactory(tmp, f"p{int(time.time() * 1000) % 10**8}")
    engines: list[EngineProc] = []
    try:
        sc = {n: f.start(staging="48M") for n in ("tp2", "tp1", "pdp2", "ddp2")}

        def eng(name: str, *args: str) -> EngineProc:
            if name in sc:
                args = (*args, "--kv-sidecar", sc[name].control_url)
            e = start_engine(name, tmp, *TINY, *args)
            engines.append(e)
            return e

        s = Parallel(
            eng("ref"),
            eng("tp2", "--tensor-parallel-size", "2"),
            eng("tp1"),
            eng("pdp2", "--role", "prefill", *("--data-parallel-size", "2")),
            eng("ddp2", "--role", "decode", *("--data-parallel-size", "2")),
            sc,
        )
        for e in engines:
            e.wait_ready()
        yield s
    except BaseException:
        for e in engines:
            print(f"--- engine {e.name} ---\n{e.tail()}")
        print(f.failure_report())
        raise
    finally:
        for e in engines:
            e.stop()
        f.close()


def _pd(
    prefill: EngineProc, decode: EngineProc, b: dict[str, Any], ranks: tuple[int, int] | None
) -> list[int]:
    """The gateway's two legs, each pinned to a DP rank when ``ranks`` is given."""
    hp = {RANK: str(ranks[0])} if ranks else {}
    hd = {RANK: str(ranks[1])} if ranks else {}
    p = httpx.post(
        prefill.url + "/v1/completions", json=prefill_request(b), headers=hp, timeout=120
    )
    assert p.status_code == 200, p.text
    d = httpx.post(
        decode.url + "/v1/completions",
        json=decode_request(b, p.json()),
        headers=hd,
        timeout=120,
    )
    return tokens(d)


def _reference(s: Parallel) -> list[list[int]]:
    def one(it: tuple[list[int], int]) -> list[int]:
        r = httpx.post(s.ref.url + "/v1/completions", json=body("dsv4-tiny", *it), timeout=120)
        return tokens(r)

    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(one, ITEMS))


def _check(s: Parallel, prefill: EngineProc, decode: EngineProc, pinned: bool = False) -> None:
    want = _reference(s)
    ranks = [((i % 2), (i // 2) % 2) if pinned else None for i in range(len(ITEMS))]
    with ThreadPoolExecutor(6) as pool:
        got = list(
            pool.map(
                lambda i: _pd(prefill, decode, body("dsv4-tiny", *ITEMS[i]), ranks[i]),
                range(len(ITEMS)),
            )
        )
    bad = [i for i in range(len(ITEMS)) if got[i] != want[i]]
    assert not bad, f"{len(bad)} differ, e.g. #{bad[0]}: PD {got[bad[0]]} vs {want[bad[0]]}"
    pulls = decode.metric("dsv4_kv_engine_transfers_total", direction="pull", outcome="ok")
    assert pulls >= len(ITEMS)
    assert decode.metric("dsv4_kv_recomputes_total") == 0
    sides = [s.sidecars[e.name] for e in (prefill, decode)]
    assert_all_free([prefill, decode], sides)


def test_prefill_tp2_to_decode_tp1_equals_one_process(stack: Parallel) -> None:
    _check(stack, stack.tp2, stack.tp1)


def test_prefill_tp1_to_decode_tp2_fills_every_tp_rank(stack: Parallel) -> None:
    # a follower that missed the import would decode from an empty cache: other tokens
    _check(stack, stack.tp1, stack.tp2)


def test_prefill_dp2_to_decode_dp2_across_ranks_equals_one_process(stack: Parallel) -> None:
    _check(stack, stack.pdp2, stack.ddp2, pinned=True)
