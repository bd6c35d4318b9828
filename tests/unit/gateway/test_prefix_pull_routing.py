"""Prefix pulls in routing, exact results: the host tier's entries and address from the events,
the pull's saving as a scorer (an idle instance that can pull beats a busy holder), the pull
put into (and taken out of) the request body at the choice, and the PD prefill request keeping
it."""

from __future__ import annotations

from dsv4_common.kv_events import (
    MEDIUM_HOST,
    BlockStored,
    KVEventBatch,
    snapshot_hash,
    snapshot_removed,
    snapshot_stored,
)
from dsv4_kvtransfer.pd_protocol import PREFIX_PULL, PrefixPullParams, prefill_request
from dsv4_serving.engine.core.prefix_hash import block_hashes
from dsv4_serving.gateway.app import Gateway
from dsv4_serving.gateway.config import GatewayConfig
from dsv4_serving.gateway.instances import Instance
from dsv4_serving.gateway.kv_index import RankCache
from dsv4_serving.gateway.policies import Choice, make_policy
from dsv4_serving.gateway.prefix_pull import (
    HostPrefix,
    PullCosts,
    host_prefixes,
    pull_saving,
    with_pull,
)
from dsv4_serving.gateway.scorers import RouteRequest, cost, parse_weights

BS = 16
# 1 KB/token at 1 GB/s (1 us/token), 1 ms fixed, 100 us/token of prefill: a pull of g tokens
# costs 10 + 0.01 g prefill tokens
COSTS = PullCosts(bytes_per_token=1000, rate_bytes_s=1e9, fixed_s=1e-3, prefill_s_per_token=1e-4)


def _holder(ids: list[int], n_blocks: int, peer: str | None = "10.0.0.7:14579") -> RankCache:
    """A rank whose device holds the prompt's first ``n_blocks`` blocks and their snapshot,
    and whose host tier holds the same prefix (the offer of a finished request)."""
    h = block_hashes(ids, BS)
    rc = RankCache()
    events = [
        BlockStored(h[:n_blocks], None, ids[: n_blocks * BS], BS),
        snapshot_stored(h[n_blocks - 1], -1, BS),
        snapshot_stored(h[n_blocks - 1], -1, BS, MEDIUM_HOST),
    ]
    rc.apply(0, KVEventBatch(ts=0.0, events=events, snapshot_bounded=True, host_tier=peer))
    return rc


def test_the_index_learns_the_tier_address_and_forgets_evicted_entries() -> None:
    ids = list(range(1, 100))
    h = block_hashes(ids, BS)
    rc = _holder(ids, 4)
    assert rc.host_tier == "10.0.0.7:14579"
    key = snapshot_hash(h[3])
    assert host_prefixes([rc], h, ids, BS) == [HostPrefix("10.0.0.7", 14579, 64, key)]
    # a rank without an address is no holder; an evicted entry is none either
    assert host_prefixes([_holder(ids, 4, peer=None)], h, ids, BS) == []
    gone = snapshot_removed(h[3], -1, MEDIUM_HOST)
    rc.apply(1, KVEventBatch(ts=0.0, events=[gone], snapshot_bounded=True, host_tier=None))
    assert rc.host == set() and rc.host_prefix(h, ids, BS) is None
    assert rc.snapshots == {key}  # the device's snapshot is another entry


def test_pull_saving_is_the_gain_less_the_pull() -> None:
    deep = [HostPrefix("h", 1, 4096, b"\x01" * 32), HostPrefix("h", 2, 1024, b"\x02" * 32)]
    # gain 4096: 1 ms + 4.096 ms = 50.96 prefill tokens
    assert pull_saving(0, deep, COSTS) == 4096 - 50.96
    # the whole entry crosses the wire, whatever the instance's own hit: 4096 tokens moved
    assert pull_saving(1024, deep, COSTS) == 3072 - (1e-3 + 4096e-6) / 1e-4
    assert pull_saving(4096 - 63, deep, COSTS) == 0.0  # below min_tokens
    assert pull_saving(0, [], COSTS) == 0.0


def _insts(ids: list[int]) -> tuple[Instance, Instance]:
    holder, idle = Instance("http://a:1", "both"), Instance("http://b:1", "both")
    holder.kv_ranks, idle.kv_ranks = [_holder(ids, 16)], [RankCache()]
    return holder, idle


def test_an_idle_instance_that_can_pull_beats_the_busy_holder() -> None:
    ids = list(range(1, 300))
    h = block_hashes(ids, BS)
    holder, idle = _insts(ids)
    assert holder.kv_ranks is not None
    found = host_prefixes(holder.kv_ranks, h, ids, BS)
    req = RouteRequest(299, h, BS, token_ids=ids, host_prefixes=found, pull_costs=COSTS)
    w = parse_weights("load=1,precise_prefix=1,prefix_pull=1")
    # the holder: its own 256 cached, nothing to gain; the idle one: 256 less the pull's 12.56
    assert cost(holder, 0, req, w) == 299 - 256
    assert cost(idle, 0, req, w) == 299 - (256 - 12.56)
    policy = make_policy("dplb", w)
    assert policy.choose([idle, holder], req) == Choice(holder, 0, 256)  # idle alike: holder
    holder.begin(0, 100)  # a generation running there (100 prompt tokens in flight)
    assert policy.choose([idle, holder], req) == Choice(idle, 0, 0)  # 143 > 55.56
    # without the pull scorer the busy holder keeps it: 143 < 299
    no_pull = make_policy("dplb", parse_weights("load=1,precise_prefix=1"))
    assert no_pull.choose([idle, holder], req) == Choice(holder, 0, 256)


def test_the_choice_puts_the_pull_into_the_body_and_a_retry_takes_it_out() -> None:
    ids = list(range(1, 300))
    h = block_hashes(ids, BS)
    holder, idle = _insts(ids)
    gw = Gateway(GatewayConfig(both_urls=["http://a:1"]))
    assert holder.kv_ranks is not None
    found = host_prefixes(holder.kv_ranks, h, ids, BS)
    req = RouteRequest(299, h, BS, token_ids=ids, host_prefixes=found, pull_costs=COSTS)
    body: dict[str, object] = {"prompt": ids, "kv_transfer_params": {"other": 1}}
    gw._pull_bodies[id(req)] = body
    gw._predicted(req, Choice(idle, 0, 0))
    pull = PrefixPullParams("10.0.0.7", 14579, 256, snapshot_hash(h[15]).hex())
    assert body["kv_transfer_params"] == {"other": 1, PREFIX_PULL: pull.to_dict()}
    # the PD prefill request keeps it beside its own params
    assert prefill_request(body)["kv_transfer_params"][PREFIX_PULL] == pull.to_dict()
    gw._observe_cached(req, {"usage": {"prompt_tokens_details": {"cached_tokens": 0}}})
    gw._predicted(req, Choice(holder, 0, 256))  # a retry on the holder: nothing to pull
    assert body["kv_transfer_params"] == {"other": 1}
    gw._predicted(req, Choice(idle, 0, 250))  # too little to gain: declined
    assert body["kv_transfer_params"] == {"other": 1}
    outcomes = {
        s.labels["outcome"]: s.value
        for f in gw.metrics.registry.collect()
        for s in f.samples
        if s.name == "dsv4_gateway_prefix_pulls_total"
    }
    assert outcomes == {"attached": 1, "computed": 1, "declined": 1}


def test_with_pull_leaves_no_empty_params() -> None:
    body: dict[str, object] = {}
    pull = PrefixPullParams("h", 1, 16, "ab" * 32)
    with_pull(body, pull)
    assert body == {"kv_transfer_params": {PREFIX_PULL: pull.to_dict()}}
    with_pull(body, None)
    assert body == {}
    assert PREFIX_PULL not in prefill_request(body)["kv_transfer_params"]


def test_a_policy_without_predictions_still_counts_the_actual_cached_tokens() -> None:
    gw = Gateway(GatewayConfig(both_urls=["http://a:1"], policy="round_robin"))
    inst = Instance("http://a:1", "prefill")
    answer = {"usage": {"prompt_tokens_details": {"cached_tokens": 48}}}
    gw._observe_cached(RouteRequest(100), answer, inst)
    samples = {
        s.name: s.value
        for f in gw.metrics.registry.collect()
        for s in f.samples
        if s.name
        in ("dsv4_gateway_actual_cached_tokens_total", "dsv4_gateway_cached_tokens_error_count")
    }
    assert samples == {
        "dsv4_gateway_actual_cached_tokens_total": 48,
        "dsv4_gateway_cached_tokens_error_count": 0,
    }
