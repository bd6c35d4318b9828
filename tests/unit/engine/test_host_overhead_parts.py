"""The pure parts of the host-overhead work: per-phase step times and their percentiles, the
coalescing mailbox between output processing and a request's handler, and the runner's
persistent block table (rows written only when a request's block list changed, gathers equal
to the padded table built from the lists)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.engine.host_times import HostTimes, StepSpans, percentile
from dsv4_serving.engine.engine.increments import Mailbox, RequestOutput, coalesce
from dsv4_serving.engine.request import EngineCoreRequest, Logprob, Request
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.engine.worker.block_table import BlockTable


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0


def test_host_times_summarises_each_phase_in_ms_and_resets() -> None:
    h = HostTimes(window=3)
    for i in range(1, 5):  # the window keeps the last 3
        h.add_step(StepSpans(i / 1e3, 2 * i / 1e3, 3 * i / 1e3))
    h.add_stream(0.5e-3)
    s = h.summary()
    assert s["schedule"] == {"count": 3, "p50_ms": 3.0, "p99_ms": 4.0, "mean_ms": pytest.approx(3)}
    assert s["prepare"]["p50_ms"] == 6.0 and s["post_process"]["p99_ms"] == 12.0
    assert s["stream"] == {"count": 1, "p50_ms": 0.5, "p99_ms": 0.5, "mean_ms": 0.5}
    h.reset()
    assert all(v["count"] == 0 for v in h.summary().values())


def _out(text: str, ids: list[int], n: int, finished: bool = False) -> RequestOutput:
    lps = [Logprob(t, -1.0, [(t, -1.0)]) for t in ids]
    return RequestOutput("r", text, ids, lps, 5, n, finished=finished)


def test_coalesce_joins_deltas_and_keeps_the_last_state() -> None:
    a, b = _out("he", [1], 1), _out("llo", [2, 3], 3, finished=True)
    b.finish_reason, b.stop_reason = "stop", 7
    got = coalesce([a, b])
    assert (got.delta_text, got.delta_token_ids, got.num_output_tokens) == ("hello", [1, 2, 3], 3)
    assert got.delta_logprobs is not None and [lp.token_id for lp in got.delta_logprobs] == [
        1,
        2,
        3,
    ]
    assert (got.finished, got.finish_reason, got.stop_reason) == (True, "stop", 7)
    assert coalesce([a]) is a


def test_mailbox_coalesces_what_arrived_since_the_last_take_and_raises_after_it() -> None:
    async def run() -> None:
        box = Mailbox()
        box.put(_out("a", [1], 1))
        box.put(_out("b", [2], 2))
        got = await box.take()  # a consumer that was behind: one increment for two steps
        assert (got.delta_text, got.delta_token_ids) == ("ab", [1, 2])
        box.put(_out("c", [3], 3))
        box.put(RuntimeError("core died"))
        assert (await box.take()).delta_text == "c"  # what came before the error first
        with pytest.raises(RuntimeError, match="core died"):
            await box.take()
        waiter = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing put: it waits
        box.put(_out("d", [4], 4, finished=True))
        assert (await waiter).finished

    asyncio.run(run())


def test_kv_block_ids_are_one_list_until_the_blocks_change() -> None:
    kv = KVCacheManager(16, 4, 2, enable_caching=False)
    req = Request(EngineCoreRequest("a", list(range(6)), SamplingParams()), None)
    assert kv.allocate_slots(req, 6)
    first = kv.block_ids("a")
    assert first == [b.block_id for b in kv.req_blocks["a"]] and len(first) == 2
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 1)  # position 6: still inside the second block
    assert kv.block_ids("a") is first
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1)  # position 8: a third block, a new list
    third = kv.block_ids("a")
    assert third is not first and third[:2] == first and len(first) == 2
    kv.free(req)
    assert kv.block_ids("a") == []


def test_block_table_writes_changed_rows_only_and_gathers_the_padded_table() -> None:
    t = BlockTable(4, width=2)
    a, b = [3, 4], [7]
    chunks = [SeqChunk(5, 1, a, 2), SeqChunk(0, 1, b, 0)]
    expect = AttentionMetadata.build(chunks, 4).block_tables
    assert torch.equal(t.gather(chunks), expect) and t.rows_written == 2
    assert torch.equal(t.gather(chunks), expect) and t.rows_written == 2  # nothing changed
    copies = [SeqChunk(5, 1, list(a), 2), SeqChunk(0, 1, list(b), 0)]  # a TP follower's step
    assert torch.equal(t.gather(copies), expect) and t.rows_written == 2
    a2 = [*a, 9, 10, 11]  # grows past the table's width
    chunks = [SeqChunk(16, 1, a2, 2), SeqChunk(1, 1, b, 0)]
    assert torch.equal(t.gather(chunks), AttentionMetadata.build(chunks, 4).block_tables)
    assert t.rows_written == 3
    # slot 2 reused by a request with fewer blocks: the old row's tail is zero again
    chunks = [SeqChunk(0, 1, [5], 2)]
    assert torch.equal(t.gather(chunks), torch.tensor([[5]]))
    assert t.table[2].tolist()[:5] == [5, 0, 0, 0, 0]
    meta = AttentionMetadata.build(chunks, 4, block_tables=t.gather(chunks))
    assert meta.block_tables.tolist() == [[5]]
