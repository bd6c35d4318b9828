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
            "labels": {
                "app.kubernetes.io/instance": owner,
                "app.kubernetes.io/managed-by": "dsv4-operator",
            },
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


def _synced(cr: dict[str, Any]) -> tuple[FakeKube, WatchCache, Controller]:
    """A deployment the watch reported, synced once into an empty namespace."""
    kube, cache = FakeKube(), WatchCache()
    cache.record_deployment(kube.put(cr))
    ctl = Controller(kube, cache)
    ctl.sync("ml", "v4")
    return kube, cache, ctl


def test_free_names_are_created_without_reads(cpu_cr: dict[str, Any]) -> None:
    kube, _, _ = _synced(cpu_cr)
    # the LWS CRD and the KV Secret (its token is never made up without a read); no GET of the
    # CR (the watch's copy) nor of any child (the name index says every name is free)
    assert kube.calls["get"] == 2 and kube.calls["apply"] == 16


def test_a_sync_of_an_unchanged_deployment_makes_no_request(cpu_cr: dict[str, Any]) -> None:
    kube, _, ctl = _synced(cpu_cr)
    kube.calls.clear()
    ctl.sync("ml", "v4")  # what it wrote (children and status) is in the cache already
    assert dict(kube.calls) == {}


def test_the_echo_of_our_own_writes_is_not_news(cpu_cr: dict[str, Any]) -> None:
    kube, cache, _ = _synced(cpu_cr)
    assert not cache.record_deployment(kube.get("DeepSeekV4Deployment", "ml", "v4") or {})
    assert not cache.record("NetworkPolicy", kube.get("NetworkPolicy", "ml", "v4-gateway") or {})
    edited = kube.put(
        {**(kube.get("NetworkPolicy", "ml", "v4-gateway") or {}), "kind": "NetworkPolicy"}
    )
    assert cache.record("NetworkPolicy", edited)


def test_a_name_taken_by_anyone_else_is_read_and_refused(cpu_cr: dict[str, Any]) -> None:
    kube, cache = FakeKube(), WatchCache()
    cache.record_deployment(kube.put(cpu_cr))
    # a predecessor's child, still being collected: its name is known, it is not ours
    cache.record("ConfigMap", kube.put({"kind": "ConfigMap", **_obj("v4-engine", "1", uid="old")}))
    Controller(kube, cache).sync("ml", "v4")
    assert kube.calls["get"] == 2 + 1 and kube.calls["apply"] == 15
    status = kube.objects[("DeepSeekV4Deployment", "ml", "v4")]["status"]
    assert "ConfigMap v4-engine already exists" in str(status)


def test_a_cache_without_the_kv_secret_reads_it_and_keeps_the_token(
    cpu_cr: dict[str, Any],
) -> None:
    kube, _, _ = _synced(cpu_cr)
    token = kube.objects[("Secret", "ml", "v4-kv-auth")]["data"]
    cache = WatchCache()  # a restart whose Secret watch lags
    cache.record_deployment(kube.objects[("DeepSeekV4Deployment", "ml", "v4")])
    Controller(kube, cache).sync("ml", "v4")
    assert kube.objects[("Secret", "ml", "v4-kv-auth")]["data"] == token


class _EditedBeforeThePatch(FakeKube):
    """Someone edits the spec between the sync's read and its status patch."""

    def patch_status(
        self, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        self.edited = self.put({**self.objects[(kind, namespace, name)], "spec": {"edited": 1}})
        self.edited["metadata"]["generation"] += 1
        self.objects[(kind, namespace, name)] = self.edited
        return super().patch_status(kind, namespace, name, status)


def test_an_edit_landing_during_a_sync_is_still_news(cpu_cr: dict[str, Any]) -> None:
    kube, cache = _EditedBeforeThePatch(), WatchCache()
    cache.record_deployment(kube.put(cpu_cr))
    Controller(kube, cache).sync("ml", "v4")
    assert cache.record_deployment(kube.edited)  # its watch event asks for another sync
