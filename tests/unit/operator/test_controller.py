"""Controller.sync against an in-memory API: what one sync reads and writes, and what it reports."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from dsv4_operator.controller import Controller
from dsv4_operator.kube import KubeError
from dsv4_operator.queue import Retry, SyncQueue
from dsv4_operator.reconcile.host_access import HostAccess
from dsv4_operator.reconcile.names import DESIRED_HASH_ANNOTATION

from .conftest import make_cr
from .fake_kube import FakeKube

CHILDREN = {
    ("ConfigMap", "v4-engine"),
    ("ConfigMap", "v4-routing"),
    ("Secret", "v4-kv-auth"),
    ("Service", "v4-prefill"),
    ("Service", "v4-decode"),
    ("Service", "v4-gateway"),
    ("StatefulSet", "v4-prefill-0"),
    ("StatefulSet", "v4-decode-0"),
    ("ServiceAccount", "v4-gateway"),
    ("Role", "v4-gateway"),
    ("RoleBinding", "v4-gateway"),
    ("Deployment", "v4-gateway"),
    ("PodDisruptionBudget", "v4-prefill"),
    ("PodDisruptionBudget", "v4-decode"),
    ("NetworkPolicy", "v4-gateway"),
    ("NetworkPolicy", "v4-engines"),
}


def _cluster(cr: dict[str, Any], crds: tuple[str, ...] = ()) -> tuple[FakeKube, Controller]:
    kube = FakeKube(crds)
    kube.put(cr)
    return kube, Controller(kube)


def _children(kube: FakeKube) -> set[tuple[str, str]]:
    return {(k, n) for (k, _, n) in kube.objects if k != "DeepSeekV4Deployment"}


def _status(kube: FakeKube) -> dict[str, Any]:
    status: dict[str, Any] = kube.objects[("DeepSeekV4Deployment", "ml", "v4")]["status"]
    return status


def _degraded(kube: FakeKube) -> dict[str, Any]:
    return next(c for c in _status(kube)["conditions"] if c["type"] == "Degraded")


def _edit_spec(kube: FakeKube, **spec: Any) -> None:
    cr = kube.objects[("DeepSeekV4Deployment", "ml", "v4")]
    cr["spec"].update(spec)
    cr["metadata"]["generation"] += 1


def test_first_sync_creates_every_child_and_reports_progressing(cpu_cr: dict[str, Any]) -> None:
    kube, ctl = _cluster(cpu_cr)
    ctl.sync("ml", "v4")
    assert _children(kube) == CHILDREN
    assert kube.calls["apply"] == 16
    assert [e["reason"] for e in kube.events] == ["Created", "Progressing"]
    assert _status(kube)["phase"] == "Progressing"
    sts = kube.objects[("StatefulSet", "ml", "v4-decode-0")]
    assert len(sts["metadata"]["annotations"][DESIRED_HASH_ANNOTATION]) == 16


def test_second_sync_of_an_unchanged_deployment_only_reads(cpu_cr: dict[str, Any]) -> None:
    kube, ctl = _cluster(cpu_cr)
    ctl.sync("ml", "v4")
    kube.calls.clear()
    kube.events.clear()
    ctl.sync("ml", "v4")
    # GET the CR; one LIST per owned kind (11, the role scales included) and one of the pods;
    # the LWS CRD check is cached
    assert dict(kube.calls) == {"get": 1, "list": 12}
    assert kube.writes() == 0 and kube.events == []


def test_a_hand_edit_is_reverted_with_one_apply(cpu_cr: dict[str, Any]) -> None:
    kube, ctl = _cluster(cpu_cr)
    ctl.sync("ml", "v4")
    kube.objects[("StatefulSet", "ml", "v4-decode-0")]["spec"]["replicas"] = 3  # kubectl scale
    kube.calls.clear()
    ctl.sync("ml", "v4")
    assert kube.calls["apply"] == 1 and kube.writes() == 1
    assert kube.objects[("StatefulSet", "ml", "v4-decode-0")]["spec"]["replicas"] == 1


def test_a_deleted_child_is_recreated(cpu_cr: dict[str, Any]) -> None:
    kube, ctl = _cluster(cpu_cr)
    ctl.sync("ml", "v4")
    del kube.objects[("ConfigMap", "ml", "v4-engine")]
    kube.events.clear()
    ctl.sync("ml", "v4")
    assert ("ConfigMap", "v4-engine") in _children(kube)
    assert [e["message"] for e in kube.events] == ["created ConfigMap v4-engine"]


def test_scaling_down_deletes_the_extra_instance(cpu_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(cpu_cr)
    cr["spec"]["prefill"]["instances"] = 2
    kube, ctl = _cluster(cr)
    ctl.sync("ml", "v4")
    assert ("StatefulSet", "v4-prefill-1") in _children(kube)
    _edit_spec(kube, prefill={**cr["spec"]["prefill"], "instances": 1})
    kube.calls.clear()
    kube.events.clear()
    ctl.sync("ml", "v4")
    assert _children(kube) == CHILDREN
    # the routing ConfigMap's instance revisions lose v4-prefill-1
    assert kube.calls["delete"] == 1 and kube.calls["apply"] == 1
    assert [e["message"] for e in kube.events] == ["deleted StatefulSet v4-prefill-1"]


def test_a_spec_change_applies_only_the_children_it_changes(cpu_cr: dict[str, Any]) -> None:
    kube, ctl = _cluster(cpu_cr)
    ctl.sync("ml", "v4")
    _edit_spec(kube, gateway={"replicas": 2})
    kube.calls.clear()
    ctl.sync("ml", "v4")
    # the gateway Deployment changes and its PodDisruptionBudget appears (GET: not someone else's)
    assert kube.calls["apply"] == 2
    assert kube.objects[("Deployment", "ml", "v4-gateway")]["spec"]["replicas"] == 2
    assert ("PodDisruptionBudget", "v4-gateway") in _children(kube)


def test_a_spec_the_cluster_cannot_serve_is_degraded_and_applies_nothing() -> None:
    kube, ctl = _cluster(
        make_cr(
            model={"preset": "dsv4-tiny", "servedName": "tiny"},
            scheduling={"workload": "LeaderWorkerSet"},
        )
    )
    ctl.sync("ml", "v4")
    assert kube.calls["apply"] == 0 and _children(kube) == set()
    assert _status(kube)["phase"] == "Degraded"
    assert _degraded(kube)["reason"] == "InvalidSpec"
    assert "LeaderWorkerSet CRD" in _degraded(kube)["message"]


def test_an_object_someone_else_owns_is_not_adopted(cpu_cr: dict[str, Any]) -> None:
    kube, ctl = _cluster(cpu_cr)
    mine = {"kind": "ConfigMap", "metadata": {"name": "v4-engine", "namespace": "ml"}, "data": {}}
    kube.put(mine)
    ctl.sync("ml", "v4")
    assert kube.objects[("ConfigMap", "ml", "v4-engine")]["data"] == {}
    assert _degraded(kube)["reason"] == "InvalidChild"
    assert _degraded(kube)["message"] == (
        "ConfigMap v4-engine already exists and is not owned by this DeepSeekV4Deployment"
    )


_BAD_TOLERATION = KubeError(
    422,
    "Invalid",
    'StatefulSet.apps "v4-prefill-0" is invalid: ...',
    [
        (
            "spec.template.spec.tolerations[0].operator",
            'Unsupported value: "Bogus": supported values: "Equal", "Exists"',
        )
    ],
)


def test_a_child_the_api_server_refuses_leaves_every_child_as_it_was(
    cpu_cr: dict[str, Any],
) -> None:
    kube, ctl = _cluster(cpu_cr)
    kube.reject[("StatefulSet", "v4-prefill-0")] = _BAD_TOLERATION
    with pytest.raises(Retry, match="refused"):
        ctl.sync("ml", "v4")
    assert kube.calls["dry_run"] == 16 and kube.calls["apply"] == 0
    assert _children(kube) == set()
    assert _status(kube)["phase"] == "Degraded"
    assert _degraded(kube)["reason"] == "ChildRejected"
    message = (
        'spec.scheduling.tolerations[0].operator: Unsupported value: "Bogus": supported values: '
        '"Equal", "Exists" (the API server refused StatefulSet v4-prefill-0)'
    )
    assert _degraded(kube)["message"] == message
    [event] = kube.events
    assert event["type"] == "Warning" and event["message"] == f"phase Degraded: {message}"


def test_a_refused_deployment_backs_off_and_a_fixed_spec_converges(
    cpu_cr: dict[str, Any],
) -> None:
    kube, ctl = _cluster(cpu_cr)
    kube.reject[("StatefulSet", "v4-prefill-0")] = _BAD_TOLERATION
    delays = []
    queue = SyncQueue(ctl.sync, delay_s=0.0)
    for _ in range(3):
        with pytest.raises(Retry):
            ctl.sync("ml", "v4")
        delays.append(queue.backoff.failed(("ml", "v4")))
    assert delays == [0.5, 1.0, 2.0]
    assert len(kube.events) == 1  # the same refusal again is no news
    del kube.reject[("StatefulSet", "v4-prefill-0")]  # the user fixed the tolerations
    _edit_spec(kube, scheduling={})
    ctl.sync("ml", "v4")
    assert _children(kube) == CHILDREN
    assert _degraded(kube)["status"] == "False"


def test_a_single_changed_child_is_its_own_dry_run(cpu_cr: dict[str, Any]) -> None:
    kube, ctl = _cluster(cpu_cr)
    ctl.sync("ml", "v4")
    before = dict(kube.calls)
    _edit_spec(kube, gateway={"routingPolicy": "round_robin"})
    ctl.sync("ml", "v4")
    assert kube.calls["dry_run"] == before["dry_run"]
    assert kube.calls["apply"] == before["apply"] + 1


class _BrokenPods(FakeKube):
    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        if kind == "Pod":
            raise KeyError("a bug")
        return super().list(kind, namespace, selector)


def test_an_unexpected_error_is_raised_not_reported_as_invalid_spec(
    cpu_cr: dict[str, Any],
) -> None:
    kube = _BrokenPods()
    kube.put(cpu_cr)
    with pytest.raises(KeyError, match="a bug"):
        Controller(kube).sync("ml", "v4")
    assert "status" not in kube.objects[("DeepSeekV4Deployment", "ml", "v4")]
    assert kube.writes() == 0


def test_a_deleted_deployment_is_not_synced(cpu_cr: dict[str, Any]) -> None:
    kube = FakeKube()
    Controller(kube).sync("ml", "v4")
    assert dict(kube.calls) == {"get": 1}


def _ready(kube: FakeKube, kind: str, name: str) -> None:
    obj = kube.objects[(kind, "ml", name)]
    obj["status"] = {"readyReplicas": 1, "updatedReplicas": 1}  # observedGeneration as generation


def test_ready_workloads_make_it_ready_with_one_status_patch_and_one_event(
    cpu_cr: dict[str, Any],
) -> None:
    kube, ctl = _cluster(cpu_cr)
    ctl.sync("ml", "v4")
    for kind, name in [
        ("StatefulSet", "v4-prefill-0"),
        ("StatefulSet", "v4-decode-0"),
        ("Deployment", "v4-gateway"),
    ]:
        _ready(kube, kind, name)
    kube.calls.clear()
    kube.events.clear()
    ctl.sync("ml", "v4")
    assert kube.calls["patch_status"] == 1 and kube.writes() == 2
    assert [e["reason"] for e in kube.events] == ["Ready"]
    status = _status(kube)
    assert (status["phase"], status["prefill"]["summary"], status["gateway"]["ready"]) == (
        "Ready",
        "1/1",
        1,
    )


def test_an_unschedulable_pod_degrades_it_with_the_schedulers_message(
    cpu_cr: dict[str, Any],
) -> None:
    kube, ctl = _cluster(cpu_cr)
    kube.put(
        {
            "kind": "Pod",
            "metadata": {
                "name": "v4-prefill-0-0",
                "namespace": "ml",
                "labels": {"app.kubernetes.io/instance": "v4"},
            },
            "status": {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/2 nodes are available",
                    }
                ]
            },
        }
    )
    ctl.sync("ml", "v4")
    assert _degraded(kube)["reason"] == "Unschedulable"
    assert _degraded(kube)["message"] == (
        "pod v4-prefill-0-0 cannot be scheduled: 0/2 nodes are available"
    )
    assert [e["type"] for e in kube.events] == ["Normal", "Warning"]


@pytest.mark.parametrize(
    ("spec", "value"),
    [
        ({}, "hostAccess.modelPath=true"),  # make_cr's model is a path on the node
        (
            {
                "model": {"preset": "dsv4-tiny", "servedName": "tiny"},
                "features": {"privileged": True},
            },
            "hostAccess.privileged=true",
        ),
    ],
)
def test_host_access_is_refused_unless_the_operator_was_installed_to_allow_it(
    spec: dict[str, Any], value: str
) -> None:
    kube, ctl = _cluster(make_cr(**spec))
    ctl.sync("ml", "v4")
    assert kube.writes() == 2  # the status and its event; no child
    assert _degraded(kube)["reason"] == "InvalidSpec"
    assert f"install the dsv4 chart with --set {value}" in _degraded(kube)["message"]

    kube = FakeKube()
    kube.put(make_cr(**spec))
    Controller(kube, host_access=HostAccess(model_path=True, privileged=True)).sync("ml", "v4")
    assert _children(kube) >= CHILDREN  # and the NPU rank tables
    pod = kube.objects[("StatefulSet", "ml", "v4-prefill-0")]["spec"]["template"]["spec"]
    if not spec:
        assert {"name": "model", "hostPath": {"path": "/data/v4", "type": "Directory"}} in pod[
            "volumes"
        ]
    else:
        assert pod["containers"][0]["securityContext"] == {"privileged": True}


def _revisions(kube: FakeKube, role: str) -> dict[str, str]:
    return {
        name: obj["metadata"]["labels"].get("serving.dsv4.io/revision", "")
        for (kind, _, name), obj in sorted(kube.objects.items())
        if kind == "StatefulSet" and obj["metadata"]["labels"]["serving.dsv4.io/role"] == role
    }


def _settle(kube: FakeKube, ready: set[str]) -> None:
    """The StatefulSet controller's part: the named instances ready, every other one not."""
    for (kind, _, name), obj in kube.objects.items():
        if kind == "StatefulSet":
            n = obj["spec"]["replicas"] if name in ready else 0
            obj["metadata"]["generation"] = 1
            obj["status"] = {"observedGeneration": 1, "readyReplicas": n, "updatedReplicas": n}


def test_a_spec_change_rolls_one_instance_at_a_time_new_ones_first(cpu_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(cpu_cr)
    cr["spec"]["prefill"]["instances"] = 2
    kube, ctl = _cluster(cr)
    ctl.sync("ml", "v4")
    (a,) = set(_revisions(kube, "prefill").values())
    _settle(kube, {"v4-prefill-0", "v4-prefill-1", "v4-decode-0"})
    _edit_spec(kube, prefill={**cr["spec"]["prefill"], "engineArgs": ["--max-num-seqs", "8"]})
    ctl.sync("ml", "v4")
    # nothing old restarts: one surge instance per role at the new revision
    revs = _revisions(kube, "prefill")
    b = revs["v4-prefill-2"]
    assert b != a and revs == {"v4-prefill-0": a, "v4-prefill-1": a, "v4-prefill-2": b}
    assert _revisions(kube, "decode") == {"v4-decode-0": a, "v4-decode-1": b}
    routing = json.loads(kube.objects[("ConfigMap", "ml", "v4-routing")]["data"]["routing.json"])
    assert routing["revision"] == b and routing["revisions"]["v4-decode-0"] == a
    sts = kube.objects[("StatefulSet", "ml", "v4-prefill-2")]
    assert sts["spec"]["template"]["spec"]["containers"][0]["command"][-4:] == [
        "--revision",
        b,
        "--max-num-seqs",
        "8",
    ]
    # the new prefill is ready, the new decode not: the old revision keeps serving whole
    _settle(kube, {"v4-prefill-0", "v4-prefill-1", "v4-prefill-2", "v4-decode-0"})
    ctl.sync("ml", "v4")
    assert _revisions(kube, "prefill")["v4-prefill-0"] == a
    # both new instances ready: an old prefill instance is replaced; the old decode waits for
    # the old prefills (a request prefilled there is decoded on an old decode)
    _settle(kube, {"v4-prefill-0", "v4-prefill-1", "v4-prefill-2", "v4-decode-0", "v4-decode-1"})
    ctl.sync("ml", "v4")
    assert _revisions(kube, "prefill") == {"v4-prefill-0": b, "v4-prefill-1": a, "v4-prefill-2": b}
    assert _revisions(kube, "decode") == {"v4-decode-0": a, "v4-decode-1": b}
    # while it restarts, nothing more goes
    _settle(kube, {"v4-prefill-1", "v4-prefill-2", "v4-decode-0", "v4-decode-1"})
    ctl.sync("ml", "v4")
    assert _revisions(kube, "prefill")["v4-prefill-1"] == a
    every = {"v4-prefill-0", "v4-prefill-1", "v4-prefill-2", "v4-decode-0", "v4-decode-1"}
    _settle(kube, every)
    ctl.sync("ml", "v4")
    assert _revisions(kube, "prefill") == {"v4-prefill-0": b, "v4-prefill-1": b, "v4-prefill-2": b}
    assert _revisions(kube, "decode")["v4-decode-0"] == a  # prefill-1 is not ready yet
    # every prefill ready at the new revision: the old decode goes, and the prefill surge
    # (each role's surge goes once that role is rolled out)
    _settle(kube, every)
    ctl.sync("ml", "v4")
    assert _revisions(kube, "prefill") == {"v4-prefill-0": b, "v4-prefill-1": b}
    assert _revisions(kube, "decode") == {"v4-decode-0": b, "v4-decode-1": b}
    _settle(kube, {"v4-prefill-0", "v4-prefill-1", "v4-decode-0", "v4-decode-1"})
    ctl.sync("ml", "v4")
    assert _revisions(kube, "decode") == {"v4-decode-0": b}  # the surge decode is gone
    _settle(kube, {"v4-prefill-0", "v4-prefill-1", "v4-decode-0"})
    ctl.sync("ml", "v4")
    status = _status(kube)
    rolled = next(c for c in status["conditions"] if c["type"] == "RolledOut")
    assert rolled["status"] == "True" and status["revision"] == b and status["updated"] == "3/3"
