"""The gateway's pull-or-recompute rule and the host tier in its index, exact results."""

from __future__ import annotations

import pytest

from dsv4_common.kv_events import (
    MEDIUM_HOST,
    BlockStored,
    KVEventBatch,
    snapshot_hash,
    snapshot_removed,
    snapshot_stored,
)
from dsv4_kvtransfer.pd_protocol import PrefixPullParams
from dsv4_serving.engine.core.prefix_hash import block_hashes
from dsv4_serving.gateway.kv_index import RankCache
from dsv4_serving.gateway.prefix_pull import HostPrefix, PullCosts, choose_pull, should_pull

# 10 KB/token at 1 GB/s: 10 us/token against 100 us/token of prefill, 1 ms fixed
COSTS = PullCosts(bytes_per_token=10_000, rate_bytes_s=1e9, fixed_s=1e-3, prefill_s_per_token=1e-4)


def test_should_pull_weighs_the_transfer_against_the_prefill() -> None:
    assert not should_pull(63, COSTS)  # below min_tokens
    # 64 tokens: 1.64 ms to pull vs 0.8 * 6.4 ms to compute
    assert should_pull(64, COSTS)
    slow = PullCosts(10_000, 1e8, 1e-3, 1e-4)  # 100 us/token: never 20% cheaper
    assert not should_pull(4096, slow)
    fixed = PullCosts(10_000, 1e9, 0.05, 1e-4, min_tokens=1)
    # gain g pulls when 0.05 + 1e-5 g < 8e-5 g, i.e. g > 714.3
    assert not should_pull(714, fixed) and should_pull(715, fixed)
    with pytest.raises(ValueError):
        PullCosts(10_000, 0.0)
    with pytest.raises(ValueError):
        PullCosts(10_000, 1e9, margin=1.0)


def test_the_transfer_is_charged_for_the_whole_entry_the_saving_for_the_gain() -> None:
    # gain 256 saves 0.8 * 25.6 ms; moving E tokens costs 1 ms + 10 us * E: E < 1948
    assert should_pull(256, COSTS, 1947) and not should_pull(256, COSTS, 1949)
    assert should_pull(256, COSTS) == should_pull(256, COSTS, 256)  # the entry is the gain
    long = HostPrefix("10.0.0.1", 14579, 65536, b"\x01" * 32)
    # a 64K-token entry whose last 256 tokens are all the instance lacks: 656 ms to move them
    assert choose_pull(65536 - 256, [long], COSTS) is None
    short = HostPrefix("10.0.0.1", 14579, 1936, b"\x02" * 32)
    assert choose_pull(1936 - 256, [short], COSTS) == PrefixPullParams(
        "10.0.0.1", 14579, 1936, "02" * 32
    )


def test_choose_pull_takes_the_deepest_holder_when_the_gain_is_worth_it() -> None:
    a = HostPrefix("10.0.0.1", 14579, 1024, b"\x01" * 32)
    b = HostPrefix("10.0.0.2", 14579, 4096, b"\x02" * 32)
    assert choose_pull(0, [a, b], COSTS) == PrefixPullParams("10.0.0.2", 14579, 4096, "02" * 32)
    assert choose_pull(4096 - 63, [a, b], COSTS) is None  # the chosen one has nearly all
    assert choose_pull(0, [], COSTS) is None


def test_the_index_keeps_host_tier_keys_apart_and_finds_the_deepest() -> None:
    bs = 4
    toks = list(range(1, 20))
    h = block_hashes(toks, bs)
    rc = RankCache()
    device = BlockStored(
        block_hashes=h[:2], parent_block_hash=None, token_ids=toks[:8], block_size=bs
    )
    events = [device, snapshot_stored(h[1], -1, bs), snapshot_stored(h[2], -1, bs, MEDIUM_HOST)]
    rc.apply(0, KVEventBatch(ts=0.0, events=events, snapshot_bounded=True))
    assert rc.usable_tokens(h, toks, bs) == 8  # the device's run, not the host entry
    assert rc.host == {snapshot_hash(h[2])}
    assert rc.host_prefix(h, toks, bs) == (12, snapshot_hash(h[2]))
    assert rc.host_prefix(h, toks[:12], bs) is None  # one prompt token left to compute
    assert rc.host_prefix(h, toks, 8) is None  # another block size
    gone = snapshot_removed(h[2], -1, MEDIUM_HOST)
    rc.apply(1, KVEventBatch(ts=0.0, events=[gone], snapshot_bounded=True))
    assert rc.host == set() and rc.snapshots == {snapshot_hash(h[1])}
