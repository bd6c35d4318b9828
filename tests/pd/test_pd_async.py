"""PD with async scheduling on both sides (``--async-scheduling on``): a prefill engine whose KV
is exported after its one token (no step past ``max_tokens`` touches the blocks or the state
slot being exported) and a decode engine whose pulled KV lands between two schedules (a TP 2
decode: replicated to its follower between two steps of the step thread; a pair with 2 MTP
drafts: the decode's steps verify drafts scheduled before the previous step's count was
known) give exactly the tokens of one synchronous engine in ``both`` mode without drafts, and
every block and staging byte is free afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.engine.common import workload
from tests.pd.engines import EngineProc, start_engine
from tests.pd.sidecars import SidecarFactory
from tests.pd.test_pd_engine import Pair, assert_all_free, body, run_pd, tokens

TINY = ["--model", "dsv4-tiny", "--num-speculative-tokens", "0"]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EngineProc, Pair, Pair, Pair]]:
    tmp = tmp_path_factory.mktemp("pd-async")
    f = SidecarFactory(tmp, f"a{int(time.time() * 1000) % 10**8}")
    engines: list[EngineProc] = []
    try:
        sp, sd, sd2, sp3, sd3 = (f.start(staging="48M") for _ in range(5))
        ref = start_engine("ref", tmp, *TINY, "--async-scheduling", "off")
        engines.append(ref)
        on = ("--async-scheduling", "on")
        prefill = start_engine(
            "prefill", tmp, "--role", "prefill", "--kv-sidecar", sp.control_url, *TINY, *on
        )
        engines.append(prefill)
        decode = start_engine(
            "decode", tmp, "--role", "decode", "--kv-sidecar", sd.control_url, *TINY, *on
        )
        engines.append(decode)
        tp2 = ("--tensor-parallel-size", "2", "--threads-per-rank", "1")
        decode2 = start_engine(
            "decode-tp2", tmp, "--role", "decode", "--kv-sidecar", sd2.control_url, *TINY, *on, *tp2
        )
        engines.append(decode2)
        mtp = ("--model", "dsv4-tiny", "--num-speculative-tokens", "2", *on)
        prefill3 = start_engine(
            "prefill-mtp", tmp, "--role", "prefill", "--kv-sidecar", sp3.control_url, *mtp
        )
        decode3 = start_engine(
            "decode-mtp", tmp, "--role", "decode", "--kv-sidecar", sd3.control_url, *mtp
        )
        engines += [prefill3, decode3]
        for e in engines:
            e.wait_ready()
        yield (
            ref,
            Pair(prefill, decode, sp, sd, "dsv4-tiny"),
            Pair(prefill, decode2, sp, sd2, "dsv4-tiny"),
            Pair(prefill3, decode3, sp3, sd3, "dsv4-tiny"),
        )
    except BaseException:
        for e in engines:
            print(f"--- engine {e.name} ---\n{e.tail()}")
        print(f.failure_report())
        raise
    finally:
        for e in engines:
            e.stop()
        f.close()


@pytest.mark.parametrize("decode", ["tp1", "tp2", "mtp2"])
def test_async_pd_tokens_equal_one_synchronous_engine(
    stack: tuple[EngineProc, Pair, Pair, Pair], decode: str
) -> None:
    ref, pair = stack[0], stack[1 + ["tp1", "tp2", "mtp2"].index(decode)]
    items = workload(10, 1) + workload(10, 2, shared_prefix=50)
    with ThreadPoolExecutor(8) as pool:
        want = list(
            pool.map(
                lambda it: tokens(
                    httpx.post(
                        ref.url + "/v1/completions", json=body("dsv4-tiny", *it), timeout=120
                    )
                ),
                items,
            )
        )
        got: list[list[int]] = []
        half = len(items) // 2  # the second wave hits prefixes the first published
        for wave in (items[:half], items[half:]):
            got += pool.map(lambda it: tokens(run_pd(pair, body("dsv4-tiny", *it))), wave)
    bad = [i for i in range(len(items)) if got[i] != want[i]]
    assert not bad, f"{len(bad)} differ, e.g. #{bad[0]}: PD {got[bad[0]]} vs {want[bad[0]]}"
    assert (
        pair.decode.metric("dsv4_kv_engine_transfers_total", direction="pull", outcome="ok") >= 20
    )
    assert pair.decode.metric("dsv4_kv_recomputes_total") == 0
    if decode == "mtp2":
        assert pair.decode.metric("vllm:spec_decode_num_draft_tokens_total") > 0
    assert_all_free([pair.prefill, pair.decode], [pair.sp, pair.sd])
