"""Routing policies, instance bookkeeping, scraping and discovery parsing: pure logic."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from dsv4_serving.engine.core.prefix_hash import block_hashes
from dsv4_serving.gateway.config import GatewayConfig
from dsv4_serving.gateway.discovery import (
    draining_from_configmap,
    instance_of,
    members_from_slices,
    routable,
)
from dsv4_serving.gateway.health import apply_scrape
from dsv4_serving.gateway.instances import Instance, InstancePool, PrefixIndex
from dsv4_serving.gateway.policies import RouteRequest, make_policy
from dsv4_serving.gateway.prompt import route_request


def _pool(n: int, role: str = "prefill", dp: int = 1) -> list[Instance]:
    return [Instance(url=f"http://127.0.0.1:{9000 + i}", role=role, dp_size=dp) for i in range(n)]  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["round_robin", "least_load", "dplb"])
def test_equal_instances_share_load_evenly(name: str) -> None:
    policy, insts = make_policy(name), _pool(4)  # type: ignore[arg-type]
    counts: Counter[str] = Counter()
    for _ in range(400):  # all instances idle at every decision: only tie-breaking decides
        counts[policy.choose(insts, RouteRequest(prompt_tokens=100)).instance.url] += 1  # type: ignore[union-attr]
    assert set(counts.values()) == {100}


def test_dplb_prefers_the_less_loaded_prefill() -> None:
    policy, insts = make_policy("dplb"), _pool(2)
    insts[0].begin(0, 5000)  # 5000 prompt tokens queued there already
    choice = policy.choose(insts, RouteRequest(prompt_tokens=100))
    assert choice is not None and choice.instance is insts[1]


def test_dplb_counts_engine_reported_waiting() -> None:
    policy, insts = make_policy("dplb"), _pool(2)
    insts[1].ranks[0].waiting = 10
    assert policy.choose(insts, RouteRequest(prompt_tokens=100)).instance is insts[0]  # type: ignore[union-attr]


def test_dplb_prefix_affinity_beats_a_small_load_difference() -> None:
    policy, insts = make_policy("dplb"), _pool(2)
    hashes = block_hashes(list(range(1024)), 16)
    insts[0].prefix.add(hashes)
    insts[0].begin(0, 200)  # a little busier, but holds the whole 1024-token prefix
    choice = policy.choose(
        insts, RouteRequest(prompt_tokens=1100, block_hashes=hashes, block_size=16)
    )
    assert choice is not None and choice.instance is insts[0]
    assert choice.cached_tokens == 1024


def test_dplb_decode_avoids_kv_pressure() -> None:
    policy, insts = make_policy("dplb"), _pool(2, "decode")
    insts[0].ranks[0].kv_usage = 0.99
    c = policy.choose(insts, RouteRequest(prompt_tokens=10, stage="decode"))
    assert c is not None and c.instance is insts[1]


def test_dplb_picks_the_idle_data_parallel_rank() -> None:
    policy, insts = make_policy("dplb"), _pool(1, "decode", dp=4)
    for r in (0, 1, 3):
        insts[0].begin(r, 10)
    c = policy.choose(insts, RouteRequest(prompt_tokens=10, stage="decode"))
    assert c is not None and c.rank == 2


def test_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")  # type: ignore[arg-type]


def test_prefix_index_matches_leading_blocks_and_is_bounded() -> None:
    idx = PrefixIndex(capacity=4)
    a = block_hashes(list(range(64)), 16)
    idx.add(a)
    assert idx.matched_blocks(a) == 4
    assert idx.matched_blocks(block_hashes([7, *range(63)], 16)) == 0
    idx.add(block_hashes(list(range(1000, 1032)), 16))
    assert len(idx) == 4 and idx.matched_blocks(a) == 0  # oldest evicted first


def test_begin_end_bookkeeping_never_goes_negative() -> None:
    inst = _pool(1)[0]
    inst.begin(0, 50)
    inst.end(0, 50)
    inst.end(0, 50)
    assert inst.inflight_requests == 0 and inst.ranks[0].inflight_tokens == 0 and inst.routed == 1


def test_pool_membership_keeps_state_of_survivors() -> None:
    pool = InstancePool()
    pool.set_members("decode", ["http://a:1", "http://b:1/"])
    pool.get("http://a:1").begin(0, 3)  # type: ignore[union-attr]
    pool.set_members("decode", ["http://a:1", "http://c:1"])
    assert sorted(i.url for i in pool.of_role("decode")) == ["http://a:1", "http://c:1"]
    assert pool.get("http://a:1").inflight_requests == 1  # type: ignore[union-attr]


def test_scrape_reads_vllm_gauges_per_dp_rank() -> None:
    inst = Instance(url="http://x:1", role="decode", dp_size=2)
    text = (
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n'
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 7.0\n'
    )
    apply_scrape(inst, text)
    assert [r.waiting for r in inst.ranks] == [3.0, 1.0]
    assert inst.ranks[1].kv_usage == 0.5 and inst.ranks[0].running == 7.0
    assert [r.waiting_for_kv for r in inst.ranks] == [0.0, 0.0]


def test_scrape_reads_the_requests_parked_for_their_kv() -> None:
    inst = Instance(url="http://x:1", role="decode")
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        "# TYPE dsv4_kv_requests_waiting_for_remote_kv gauge\n"
        'dsv4_kv_requests_waiting_for_remote_kv{model_name="m"} 2.0\n'
    )
    apply_scrape(inst, text)
    assert (inst.ranks[0].waiting, inst.ranks[0].waiting_for_kv) == (3.0, 2.0)


def test_scrape_reads_the_prompt_and_prefix_cache_token_counters() -> None:
    inst = Instance(url="http://x:1", role="prefill")
    text = (
        "# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{model_name="m"} 5000.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 1200.0\n'
    )
    apply_scrape(inst, text)
    assert (inst.ranks[0].prompt_tokens, inst.ranks[0].cached_tokens) == (5000.0, 1200.0)


def test_endpointslices_give_ready_leaders_per_role() -> None:
    slices: list[dict[str, Any]] = [
        {
            "metadata": {"name": "v4-prefill-abc", "labels": {"serving.dsv4.io/role": "prefill"}},
            "ports": [{"name": "kv", "port": 14579}, {"name": "http", "port": 8000}],
            "endpoints": [
                {
                    "addresses": ["10.0.0.1"],
                    "conditions": {"ready": True},
                    "targetRef": {"name": "v4-prefill-0-0"},
                },
                {
                    "addresses": ["10.0.0.2"],
                    "conditions": {"ready": True},
                    "targetRef": {"name": "v4-prefill-0-1"},
                },
                {
                    "addresses": ["10.0.0.3"],
                    "conditions": {"ready": False},
                    "targetRef": {"name": "v4-prefill-1-0"},
                },
            ],
        },
        {
            "metadata": {"name": "v4-decode-x", "labels": {"serving.dsv4.io/role": "decode"}},
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {
                    "addresses": ["fd00::5"],
                    "conditions": {"ready": True},
                    "targetRef": {"name": "v4-decode-0-0"},
                }
            ],
        },
        {
            "metadata": {"name": "v4-gateway-q", "labels": {"serving.dsv4.io/role": "gateway"}},
            "ports": [],
            "endpoints": [],
        },
    ]
    m = members_from_slices(slices)
    assert m["prefill"] == {"http://10.0.0.1:8000"}
    assert m["decode"] == {"http://[fd00::5]:8000"}
    assert m["both"] == set()
    # an instance the autoscaler drains gets no new requests
    m = members_from_slices(slices, frozenset({"v4-prefill-0"}))
    assert m["prefill"] == set() and m["decode"] == {"http://[fd00::5]:8000"}


def test_routing_configmap_lists_draining_instances() -> None:
    assert instance_of("v4-decode-12-0") == "v4-decode-12"
    cm = {"data": {"routing.json": '{"draining": ["v4-decode-1", "v4-prefill-2"]}'}}
    assert draining_from_configmap(cm) == {"v4-decode-1", "v4-prefill-2"}
    assert draining_from_configmap({"data": {"routing.json": '{"draining": []}'}}) == set()
    assert draining_from_configmap(None) == set()
    assert draining_from_configmap({"data": {"routing.json": "not json"}}) == set()
    assert draining_from_configmap({"data": {"routing.json": "[1, 2]"}}) == set()


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        ({"ready": True, "serving": True, "terminating": False}, True),
        # publishNotReadyAddresses: ready is always true, serving is the pod's readiness
        ({"ready": True, "serving": False, "terminating": False}, False),
        # a pod being deleted, still passing its probes: no new requests
        ({"ready": True, "serving": True, "terminating": True}, False),
        ({"ready": False, "serving": True, "terminating": True}, False),
        # older servers: only ready; all unset: unknown, treated as routable
        ({"ready": False}, False),
        ({"ready": True}, True),
        ({}, True),
    ],
)
def test_an_endpoint_is_routable_when_serving_and_not_terminating(
    conditions: dict[str, bool], expected: bool
) -> None:
    assert routable(conditions) is expected
    ep = {"addresses": ["10.0.0.9"], "conditions": conditions, "targetRef": {"name": "v-d-0-0"}}
    s = {
        "metadata": {"name": "s", "labels": {"serving.dsv4.io/role": "decode"}},
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [ep],
    }
    assert members_from_slices([s])["decode"] == ({"http://10.0.0.9:8000"} if expected else set())


def test_route_request_hashes_token_prompts_with_the_engine_hash() -> None:
    r = route_request({"prompt": list(range(40))}, False, lambda s: [], 16)
    n, hashes = r.prompt_tokens, list(r.block_hashes)
    assert n == 40 and hashes == block_hashes(list(range(40)), 16)
    r = route_request(
        {"messages": [{"role": "user", "content": "x" * 100}]}, True, lambda s: list(s.encode()), 16
    )
    n, hashes = r.prompt_tokens, list(r.block_hashes)
    assert n == len("user\n" + "x" * 100 + "\n") and len(hashes) == n // 16


def test_config_errors_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--prefill and --decode"):
        GatewayConfig(prefill_urls=["http://a:1"])
    with pytest.raises(ValueError, match="http:// or https://"):
        GatewayConfig(both_urls=["a:1"])
    with pytest.raises(ValueError, match="--port"):
        GatewayConfig(both_urls=["http://a:1"], port=0)


def test_a_kv_transfer_error_is_recognised_by_the_pd_protocol_type() -> None:
    from dsv4_common.errors import openai_error
    from dsv4_kvtransfer.pd_protocol import KV_TRANSFER_ERROR_TYPE
    from dsv4_serving.gateway.proxy import _kv_transfer_error

    kv = openai_error(503, "KV transfer failed (reason=timeout)", type_=KV_TRANSFER_ERROR_TYPE)
    assert _kv_transfer_error(json.dumps(kv).encode())
    assert not _kv_transfer_error(json.dumps(openai_error(500, "engine broke")).encode())
    assert not _kv_transfer_error(b'{"error": {"type": "KVTransferError"}}')  # the old string
    assert not _kv_transfer_error(b"<html>bad gateway</html>")
    assert not _kv_transfer_error(b"[1, 2]")


@pytest.mark.parametrize("name", ["round_robin", "dplb"])
def test_prefill_and_decode_rotate_independently(name: str) -> None:
    policy = make_policy(name)  # type: ignore[arg-type]
    prefills, decodes = _pool(2, "prefill"), _pool(2, "decode")
    pairs: Counter[tuple[str, str]] = Counter()
    for _ in range(8):
        p = policy.choose(prefills, RouteRequest(prompt_tokens=10))
        d = policy.choose(decodes, RouteRequest(prompt_tokens=10, stage="decode"))
        pairs[(p.instance.url, d.instance.url)] += 1  # type: ignore[union-attr]
    assert len({p for p, _ in pairs}) == 2 and len({d for _, d in pairs}) == 2
