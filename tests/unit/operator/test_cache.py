"""The watch cache: syncs read children and pods from memory; lag costs reads, never writes."""

from __future__ import annotations

from typing import Any

from dsv4_operator.api.spec import parse
from dsv4_operator.cache import WatchCache
from dsv4_operator.controller import Controller

from .fake_kube import FakeKube


def _obj(name: str, rv: str, owner: str = "v4", uid: str = "uid-1") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "resourceVersion": rv,
            "labels": {"app.kubernetes.io/instance": owner},
            "ownerReferences": [{"uid": uid}],
        }
    }


def test_an_older_event_never_replaces_a_newer_copy(cpu_cr: dict[str, Any]) -> None:
    cache = WatchCache()
    cache.record("ConfigMap", _obj("v4-engine", "7"))
    cache.record("ConfigMap", _obj("v4-engine", "5"))
    live = cache.children(parse(cpu_cr), lws_available=False)
    assert live[("ConfigMap", "v4-engine")]["metadata"]["resourceVersion"] == "7"


def test_children_are_this_deployments_by_label_and_owner_uid(cpu_cr: dict[str, Any]) -> None:
    cache = WatchCache()
    cache.record("ConfigMap", _obj("v4-engine", "1"))
    cache.record("ConfigMap", _obj("v4-old", "1", uid="uid-of-a-predecessor"))
    cache.record("ConfigMap", _obj("other-engine", "1", owner="other"))
    cache.record("Pod", _obj("v4-prefill-0-0", "1"))
    cache.record("LeaderWorkerSet", _obj("v4-prefill", "1"))
    spec = parse(cpu_cr)
    assert list(cache.children(spec, lws_available=False)) == [("ConfigMap", "v4-engine")]
    assert ("LeaderWorkerSet", "v4-prefill") in cache.children(spec, lws_available=True)
    assert [p["metadata"]["name"] for p in cache.pods(spec)] == ["v4-prefill-0-0"]
    cache.forget("Pod", _obj("v4-prefill-0-0", "2"))
    assert cache.pods(spec) == []


def test_a_sync_of_an_unchanged_deployment_from_the_cache_makes_one_request(
    cpu_cr: dict[str, Any],
) -> None:
    kube, cache = FakeKube(), WatchCache()
    kube.put(cpu_cr)
    ctl = Controller(kube, cache)
    ctl.sync("ml", "v4")  # an empty cache: every child is read (404) and created
    # the CR, the LWS CRD, the KV Secret (for its token) and then each child before creating it
    assert kube.calls["get"] == 3 + 15 and kube.calls["apply"] == 15
    kube.calls.clear()
    ctl.sync("ml", "v4")  # what it wrote is in the cache already
    assert dict(kube.calls) == {"get": 1}


def test_a_cache_that_lags_costs_reads_not_writes(cpu_cr: dict[str, Any]) -> None:
    kube = FakeKube()
    kube.put(cpu_cr)
    Controller(kube, WatchCache()).sync("ml", "v4")
    kube.calls.clear()
    Controller(kube, WatchCache()).sync("ml", "v4")  # a restart before the watches caught up
    assert kube.writes() == 0  # the KV token in particular is kept
    # the CR, the LWS CRD, the KV Secret, each other child
    assert dict(kube.calls) == {"get": 3 + 14}
