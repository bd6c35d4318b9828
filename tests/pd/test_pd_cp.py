"""PD with a context-parallel prefill, real processes on 127.0.0.1: a CP 2 prefill instance
(``--role prefill -cp 2``) hands its KV to a TP 1 decode, and the decode answers with the
single-process ``both`` engine's greedy tokens.

  ref    both, dsv4-tiny, one process              the reference
  pcp2   prefill, CP 2, with a sidecar              each chunk split zig-zag over 2 ranks
  dec    decode, TP 1, with a sidecar

Every CP rank writes the whole (replicated) cache: the per-layer gather gives each rank every
row's cache inputs. So CP rank 0, the core, exports its own cache as a non-CP instance would,
and the decode imports it unchanged (``docs/parallelism.md``). The prompts (20-1100 tokens,
in 512-token chunks) split over the ranks but for the shortest; one hits another's prefix in
the prefill instance's cache, so the export carries blocks CP computed in an earlier request.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dsv4_serving.engine.worker.worker import PROFILE_ENV
from tests.helpers import wait_for
from tests.pd.engines import EngineProc, start_engine
from tests.pd.sidecars import SidecarFactory
from tests.pd.test_pd_engine import Pair, assert_all_free, body, run_pd, tokens

pytestmark = pytest.mark.pd

TINY = [
    *("--model", "dsv4-tiny", "--num-speculative-tokens", "0", "--threads-per-rank", "1"),
    *("--max-model-len", "2048", "--max-num-batched-tokens", "512"),
]


def _items() -> list[tuple[list[int], int]]:
    rng = random.Random(293)
    a = [rng.randrange(256) for _ in range(1100)]
    b = a[:600] + [rng.randrange(256) for _ in range(300)]  # prefix hit on a's blocks
    c = [rng.randrange(256) for _ in range(400)]
    d = [rng.randrange(256) for _ in range(20)]  # too short to split: every rank runs it
    return [(a, 6), (b, 5), (c, 7), (d, 4)]


@dataclass
class Stack:
    ref: EngineProc
    pair: Pair
    profiles: Path  # the prefill ranks' profiles, written when they exit


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("pd-cp")
    f = SidecarFactory(tmp, f"c{int(time.time() * 1000) % 10**8}")
    engines: list[EngineProc] = []
    try:
        sp, sd = f.start(staging="64M"), f.start(staging="64M")

        def eng(name: str, *args: str) -> EngineProc:
            e = start_engine(name, tmp, *TINY, *args)
            engines.append(e)
            return e

        ref = eng("ref")
        os.environ[PROFILE_ENV] = str(tmp / "profiles")  # the prefill's ranks only
        try:
            pre = eng("pcp2", "--role", "prefill", "-cp", "2", "--kv-sidecar", sp.control_url)
        finally:
            del os.environ[PROFILE_ENV]
        dec = eng("dec", "--role", "decode", "--kv-sidecar", sd.control_url)
        for e in engines:
            e.wait_ready(300)  # 4 processes starting on 2 shared cores
        yield Stack(ref, Pair(pre, dec, sp, sd, "dsv4-tiny"), tmp / "profiles")
    except BaseException:
        for e in engines:
            print(f"--- engine {e.name} ---\n{e.tail()}")
        print(f.failure_report())
        raise
    finally:
        for e in engines:
            e.stop()
        f.close()


def test_cp2_prefill_to_tp1_decode_equals_one_process(stack: Stack) -> None:
    items = _items()
    want = [
        tokens(
            httpx.post(stack.ref.url + "/v1/completions", json=body("dsv4-tiny", *it), timeout=300)
        )
        for it in items
    ]
    pair = stack.pair

    def pd(it: tuple[list[int], int]) -> list[int]:
        return tokens(run_pd(pair, body("dsv4-tiny", *it), timeout=300))

    got = [pd(items[0])]  # first alone: the next one's prefix is then cached
    with ThreadPoolExecutor(3) as pool:
        got += list(pool.map(pd, items[1:]))
    bad = [i for i in range(len(items)) if got[i] != want[i]]
    assert not bad, f"{len(bad)} differ, e.g. #{bad[0]}: PD {got[bad[0]]} vs {want[bad[0]]}"
    dec = pair.decode
    assert dec.metric("dsv4_kv_engine_transfers_total", direction="pull", outcome="ok") >= len(
        items
    )
    assert dec.metric("dsv4_kv_recomputes_total") == 0
    assert pair.prefill.metric("vllm:prefix_cache_hits_total") >= 512  # b reused a's blocks
    assert_all_free([pair.prefill, dec], [pair.sp, pair.sd])
    pair.prefill.stop()  # its ranks write their profiles as they exit
    files = [stack.profiles / f"rank-{r}.json" for r in range(2)]
    wait_for("the prefill ranks' profiles", lambda: all(f.exists() for f in files), 30)
    split = [json.loads(f.read_text())["cp_split_steps"] for f in files]
    print(f"prefill ranks split {split} steps")
    assert split[0] == split[1] >= 4, split  # CP really split the prompts' chunks
