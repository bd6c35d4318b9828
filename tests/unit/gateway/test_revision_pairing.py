"""Prefill and decode are paired within one deployment revision only (rollouts): the pure
choice of revision, the routing ConfigMap's revisions, and the proxy's choices."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_serving.gateway.config import GatewayConfig
from dsv4_serving.gateway.discovery import Routing, routing_from_configmap, url_revisions
from dsv4_serving.gateway.instances import Instance, InstancePool
from dsv4_serving.gateway.metrics import GatewayMetrics
from dsv4_serving.gateway.policies import RouteRequest, make_policy, paired_revisions
from dsv4_serving.gateway.proxy import Proxy

pytestmark = pytest.mark.unit


def _insts(role: str, *revisions: str) -> list[Instance]:
    base = 9000 if role == "prefill" else 9100
    return [
        Instance(url=f"http://127.0.0.1:{base + i}", role=role, revision=r)  # type: ignore[arg-type]
        for i, r in enumerate(revisions)
    ]


def test_the_newest_revision_is_preferred_once_it_has_a_pair() -> None:
    p, d = _insts("prefill", "old", "old", "new"), _insts("decode", "old", "new")
    assert paired_revisions(p, d, newest="new") == ["new", "old"]


def test_without_a_new_pair_the_revision_with_most_pairs_serves() -> None:
    p, d = _insts("prefill", "a", "a", "b", "c", "c"), _insts("decode", "a", "a", "c", "new")
    # "new" has no prefill, "b" no decode: neither can serve a request
    assert paired_revisions(p, d, newest="new") == ["a", "c"]


def test_no_complete_revision_means_no_pair() -> None:
    assert paired_revisions(_insts("prefill", "a"), _insts("decode", "b"), newest="b") == []


def test_instances_of_unknown_revision_pair_among_themselves() -> None:
    assert paired_revisions(_insts("prefill", ""), _insts("decode", ""), newest="") == [""]


def test_the_routing_configmap_names_each_instances_revision() -> None:
    doc = '{"draining": ["v4-decode-1"], "revision": "b", "revisions": {"v4-prefill-0": "a"}}'
    routing = routing_from_configmap({"data": {"routing.json": doc}})
    assert routing == Routing(frozenset({"v4-decode-1"}), "b", {"v4-prefill-0": "a"})
    # an older operator's document: drains only
    assert routing_from_configmap({"data": {"routing.json": '{"draining": []}'}}) == Routing()
    assert routing_from_configmap({"data": {"routing.json": '{"revisions": 3}'}}) == Routing()


def test_each_engine_url_gets_its_instances_revision() -> None:
    slices: list[dict[str, Any]] = [
        {
            "metadata": {"name": "s", "labels": {"serving.dsv4.io/role": "prefill"}},
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "targetRef": {"name": "v4-prefill-0-0"}},
                {"addresses": ["10.0.0.2"], "targetRef": {"name": "v4-prefill-2-0"}},
                {"addresses": ["10.0.0.3"], "targetRef": {"name": "v4-prefill-3-0"}},
            ],
        }
    ]
    revs = {"v4-prefill-0": "a", "v4-prefill-2": "b"}
    assert url_revisions(slices, revs) == {
        "http://10.0.0.1:8000": "a",
        "http://10.0.0.2:8000": "b",
    }


def _proxy(prefill: dict[str, str], decode: dict[str, str], newest: str) -> Proxy:
    pool = InstancePool()
    pool.set_members("prefill", prefill, revisions=prefill)
    pool.set_members("decode", decode, revisions=decode)
    pool.newest_revision = newest
    cfg = GatewayConfig(prefill_urls=list(prefill), decode_urls=list(decode))
    return Proxy(cfg, pool, make_policy("round_robin"), GatewayMetrics())


def test_the_proxy_pairs_a_decode_of_its_prefills_revision_only() -> None:
    proxy = _proxy(
        {"http://p-old:1": "old", "http://p-new:1": "new"},
        {"http://d-old:1": "old", "http://d-new:1": "new"},
        newest="new",
    )
    req = RouteRequest(prompt_tokens=10)
    for _ in range(4):  # round robin would alternate: pairing keeps to the newest revision
        p = proxy._choose("prefill", req, set())
        assert p is not None and p.instance.url == "http://p-new:1"
    # a retry after the new prefill failed falls back to the old revision, whole
    p = proxy._choose("prefill", req, {"http://p-new:1"})
    assert p is not None and p.instance.revision == "old"
    decode_req = RouteRequest(prompt_tokens=10, stage="decode", revision="old")
    for _ in range(4):
        d = proxy._choose("decode", decode_req, set())
        assert d is not None and d.instance.url == "http://d-old:1"
    # its only decode failed: no decode of another revision is taken
    assert proxy._choose("decode", decode_req, {"http://d-old:1"}) is None
    pairs = proxy.metrics.registry.get_sample_value(
        "dsv4_gateway_pd_pairs_total", {"prefill_revision": "old", "decode_revision": "old"}
    )
    assert pairs == 4


def test_another_revision_at_a_known_address_is_another_instance() -> None:
    pool = InstancePool()
    pool.set_members("decode", ["http://d:1"], revisions={"http://d:1": "a"})
    inst = pool.all()[0]
    pool.set_members("decode", ["http://d:1"], revisions={"http://d:1": "a"})
    assert pool.all()[0] is inst  # same revision: its state is kept
    pool.set_members("decode", ["http://d:1"], revisions={"http://d:1": "b"})
    # a request paired under the old revision still sees "a" on the instance it holds
    assert inst.revision == "a" and pool.all()[0].revision == "b"
