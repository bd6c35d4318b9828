"""The operator end to end on the real control plane with kwok Ascend nodes."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_for
from tests.k8s.operator_fixtures import OperatorService, apply_yaml, kubectl_json, warning_events

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"
CHILD_KINDS = "statefulsets,deployments,services,configmaps,secrets,serviceaccounts,roles,rolebindings,poddisruptionbudgets,networkpolicies"


def _npu_cr(name: str, **spec: Any) -> dict[str, Any]:
    """A DeepSeekV4Deployment on NPU nodes (the defaults: 8 NPUs per node) with ``spec`` added."""
    return {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DeepSeekV4Deployment",
        "metadata": {"name": name},
        "spec": {"model": {"preset": "dsv4-tiny", "servedName": "v4"}, **spec},
    }


def _children(cluster: Any, ns: str, name: str) -> dict[str, dict[str, Any]]:
    items = kubectl_json(
        cluster, "get", CHILD_KINDS, "-n", ns, "-l", f"app.kubernetes.io/instance={name}"
    )["items"]
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in items}


def _status(cluster: Any, ns: str, name: str) -> dict[str, Any]:
    return kubectl_json(cluster, "get", "dsv4", name, "-n", ns).get("status") or {}


def _phase_is(cluster: Any, ns: str, name: str, phase: str) -> dict[str, Any] | None:
    st = _status(cluster, ns, name)
    return st if st.get("phase") == phase else None


@pytest.fixture(scope="module")
def tiny(k8s_cluster: Any, operator: OperatorService) -> Iterator[tuple[Any, str]]:
    """manifests/examples/tiny-cpu.yaml applied once, in a namespace of its own; the tests below
    run in file order, each checking one behaviour of the same deployment."""
    ns = f"tiny-{uuid.uuid4().hex[:8]}"
    k8s_cluster.kubectl("create", "namespace", ns)
    apply_yaml(k8s_cluster, (EXAMPLES / "tiny-cpu.yaml").read_text(), ns)
    yield k8s_cluster, ns
    k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false")


TINY_CHILDREN = {
    "StatefulSet/tiny-prefill-0",
    "StatefulSet/tiny-decode-0",
    "Deployment/tiny-gateway",
    "Service/tiny-prefill",
    "Service/tiny-decode",
    "Service/tiny-gateway",
    "ConfigMap/tiny-engine",
    "ConfigMap/tiny-routing",
    "Secret/tiny-kv-auth",
    "ServiceAccount/tiny-gateway",
    "Role/tiny-gateway",
    "RoleBinding/tiny-gateway",
    "PodDisruptionBudget/tiny-prefill",
    "PodDisruptionBudget/tiny-decode",
    "NetworkPolicy/tiny-gateway",
    "NetworkPolicy/tiny-engines",
}


def _patch(cluster: Any, ns: str, spec: dict[str, Any]) -> None:
    cluster.kubectl(
        "patch", "dsv4", "tiny", "-n", ns, "--type=merge", "-p", json.dumps({"spec": spec})
    )


def _ready_with(cluster: Any, ns: str, prefill: str) -> bool:
    st = _status(cluster, ns, "tiny")
    return st.get("prefill", {}).get("summary") == prefill and st.get("phase") == "Ready"


def test_tiny_example_creates_every_child(tiny: tuple[Any, str]) -> None:
    cluster, ns = tiny
    wait_for(
        "every child", lambda: set(_children(cluster, ns, "tiny")) >= TINY_CHILDREN, timeout_s=60
    )
    assert set(_children(cluster, ns, "tiny")) == TINY_CHILDREN


def test_tiny_example_becomes_ready_with_its_printer_columns(tiny: tuple[Any, str]) -> None:
    cluster, ns = tiny
    st = wait_for("phase Ready", lambda: _phase_is(cluster, ns, "tiny", "Ready"), timeout_s=120)
    assert st["prefill"]["summary"] == "1/1" and st["decode"]["summary"] == "1/1"
    assert st["observedGeneration"] == 1
    pods = kubectl_json(cluster, "get", "pods", "-n", ns, "-l", "serving.dsv4.io/role=prefill")
    assert [p["status"]["phase"] for p in pods["items"]] == ["Running"]
    assert [c["name"] for c in pods["items"][0]["spec"]["containers"]] == ["engine", "kv-sidecar"]
    table = cluster.kubectl("get", "dsv4", "-n", ns).splitlines()
    assert table[0].split() == [
        "NAME",
        "PREFILL",
        "DECODE",
        "PHASE",
        "UPDATED",
        "TTFT",
        "TPOT",
        "AGE",
    ]
    assert table[1].split()[:5] == ["tiny", "1/1", "1/1", "Ready", "2/2"]


def test_scaling_up_adds_an_instance_that_becomes_ready(tiny: tuple[Any, str]) -> None:
    cluster, ns = tiny
    _patch(cluster, ns, {"prefill": {"instances": 2}})
    wait_for(
        "StatefulSet tiny-prefill-1",
        lambda: "StatefulSet/tiny-prefill-1" in _children(cluster, ns, "tiny"),
    )
    wait_for("prefill 2/2 and Ready", lambda: _ready_with(cluster, ns, "2/2"), timeout_s=120)


def test_scaling_down_prunes_the_extra_instance(tiny: tuple[Any, str]) -> None:
    cluster, ns = tiny
    _patch(cluster, ns, {"prefill": {"instances": 1}})
    wait_for(
        "tiny-prefill-1 pruned",
        lambda: "StatefulSet/tiny-prefill-1" not in _children(cluster, ns, "tiny"),
    )
    wait_for("prefill 1/1 and Ready", lambda: _ready_with(cluster, ns, "1/1"), timeout_s=120)


def _revisions(cluster: Any, ns: str) -> dict[str, str]:
    sts = kubectl_json(cluster, "get", "sts", "-n", ns, "-l", "app.kubernetes.io/instance=tiny")
    return {
        o["metadata"]["name"]: o["metadata"]["labels"].get("serving.dsv4.io/revision", "")
        for o in sts["items"]
    }


def test_an_engine_flag_change_rolls_out_new_instances_first(
    tiny: tuple[Any, str], operator: OperatorService
) -> None:
    cluster, ns = tiny
    before = _status(cluster, ns, "tiny")["revision"]
    assert set(_revisions(cluster, ns).values()) == {before}
    _patch(cluster, ns, {"decode": {"engineArgs": ["--max-num-seqs", "8"]}})
    st = wait_for(
        "RolledOut",
        lambda: (
            (s := _status(cluster, ns, "tiny"))["revision"] != before
            and s.get("phase") == "Ready"
            and s
        ),
        timeout_s=120,
    )
    after = st["revision"]
    assert _revisions(cluster, ns) == {"tiny-prefill-0": after, "tiny-decode-0": after}
    assert next(c for c in st["conditions"] if c["type"] == "RolledOut")["status"] == "True"
    routing = kubectl_json(cluster, "get", "configmap", "tiny-routing", "-n", ns)
    assert json.loads(routing["data"]["routing.json"])["revision"] == after
    pods = kubectl_json(cluster, "get", "pods", "-n", ns, "-l", "serving.dsv4.io/role=decode")
    command = pods["items"][0]["spec"]["containers"][0]["command"]
    assert command[-4:] == ["--revision", after, "--max-num-seqs", "8"]
    # new instances first: a surge instance per role came and went (the order of each step is
    # tests/unit/operator/test_controller.py's; kwok pods turn Ready too fast to watch it here)
    events = kubectl_json(
        cluster, "get", "events", "-n", ns, "--field-selector", "involvedObject.name=tiny"
    )["items"]
    said = " ".join(e["message"] for e in events)
    for surge in ("StatefulSet tiny-prefill-1", "StatefulSet tiny-decode-1"):
        assert f"created {surge}" in said or f", {surge}" in said, said
        assert "deleted " in said and surge in said
    # and then it rests: no write once rolled out
    time.sleep(3)
    writes = {v: operator.metric("dsv4_operator_api_requests_total", verb=v) for v in ("apply",)}
    time.sleep(5)
    assert writes == {
        v: operator.metric("dsv4_operator_api_requests_total", verb=v) for v in ("apply",)
    }


def test_a_hand_edit_of_a_child_is_reverted(tiny: tuple[Any, str]) -> None:
    cluster, ns = tiny
    cluster.kubectl("scale", "statefulset/tiny-decode-0", "-n", ns, "--replicas=3")
    wait_for(
        "decode replicas reverted to 1",
        lambda: (
            kubectl_json(cluster, "get", "sts", "tiny-decode-0", "-n", ns)["spec"]["replicas"] == 1
        ),
    )


def test_a_deleted_child_is_recreated(tiny: tuple[Any, str]) -> None:
    cluster, ns = tiny
    cluster.kubectl("delete", "configmap", "tiny-engine", "-n", ns)
    wait_for(
        "engine ConfigMap recreated",
        lambda: "ConfigMap/tiny-engine" in _children(cluster, ns, "tiny"),
    )
    wait_for("Ready again", lambda: _phase_is(cluster, ns, "tiny", "Ready"), timeout_s=120)


def test_events_say_what_the_operator_did(tiny: tuple[Any, str]) -> None:
    cluster, ns = tiny
    events = kubectl_json(
        cluster, "get", "events", "-n", ns, "--field-selector", "involvedObject.name=tiny"
    )["items"]
    messages = {e["reason"]: e["message"] for e in events}
    assert {"Created", "Deleted", "Ready"} <= set(messages)
    assert "deleted StatefulSet tiny-prefill-1" in [
        e["message"] for e in events if e["reason"] == "Deleted"
    ]


def test_a_restarted_operator_changes_nothing(
    tiny: tuple[Any, str], operator: OperatorService, operator_kubeconfig: Path
) -> None:
    cluster, ns = tiny
    wait_for("Ready", lambda: _phase_is(cluster, ns, "tiny", "Ready"), timeout_s=120)
    time.sleep(2)
    before = {
        k: v["metadata"]["resourceVersion"] for k, v in _children(cluster, ns, "tiny").items()
    }
    cr_before = kubectl_json(cluster, "get", "dsv4", "tiny", "-n", ns)["metadata"]
    operator.stop()
    restarted = OperatorService(operator_kubeconfig, cluster.log_dir).launch()
    try:
        wait_for(
            "the restarted operator to sync",
            lambda: restarted.metric("dsv4_operator_syncs_total", result="ok") >= 1,
        )
        time.sleep(3)
        after = {
            k: v["metadata"]["resourceVersion"] for k, v in _children(cluster, ns, "tiny").items()
        }
        assert after == before
        cr_after = kubectl_json(cluster, "get", "dsv4", "tiny", "-n", ns)["metadata"]
        assert cr_after["resourceVersion"] == cr_before["resourceVersion"]
        # not even a no-op write: every live child already holds what would be applied
        for verb in ("dry_run", "apply", "delete", "patch_status", "create"):
            assert restarted.metric("dsv4_operator_api_requests_total", verb=verb) == 0, verb
    finally:
        restarted.stop()
        operator.launch()  # leave the module's operator running for the next tests


def test_deleting_the_deployment_collects_every_child(tiny: tuple[Any, str]) -> None:
    cluster, ns = tiny
    cluster.kubectl("delete", "dsv4", "tiny", "-n", ns, "--wait=true", "--timeout=60s")
    wait_for(
        "every child garbage-collected", lambda: not _children(cluster, ns, "tiny"), timeout_s=60
    )


def test_npu_pods_are_scheduled_and_rank_table_completes(k8s_cluster, operator, namespace) -> None:
    cluster, ns = k8s_cluster, namespace
    cr = _npu_cr("npu", prefill={"parallelism": {"tp": 8}}, decode={"parallelism": {"tp": 8}})
    apply_yaml(cluster, json.dumps(cr), ns)

    def running_engine_pods() -> list[dict[str, Any]] | None:
        pods = kubectl_json(
            cluster,
            "get",
            "pods",
            "-n",
            ns,
            "-l",
            "app.kubernetes.io/instance=npu,serving.dsv4.io/role in (prefill,decode)",
        )["items"]
        ok = len(pods) == 2 and all(p["status"].get("phase") == "Running" for p in pods)
        return pods if ok else None

    pods = wait_for("both NPU engine pods running", running_engine_pods, timeout_s=90)
    for p in pods:
        engine = p["spec"]["containers"][0]
        assert engine["resources"]["limits"]["huawei.com/Ascend910"] == "8"
        assert p["spec"]["nodeName"] in cluster.nodes
    cm = kubectl_json(cluster, "get", "configmap", "npu-prefill-0-ranktable", "-n", ns)
    assert json.loads(cm["data"]["hccl.json"])["status"] == "initializing"

    # the device plugin would annotate each pod with the NPUs it got; do what it does
    for p in pods:
        devices = {
            "devices": [{"device_id": str(i), "device_ip": f"192.168.1.{i}"} for i in range(8)]
        }
        cluster.kubectl(
            "annotate",
            "pod",
            p["metadata"]["name"],
            "-n",
            ns,
            f"ascend.kubectl.kubernetes.io/ascend-910-configuration={json.dumps(devices)}",
        )

    def completed() -> dict[str, Any] | None:
        cm = kubectl_json(cluster, "get", "configmap", "npu-prefill-0-ranktable", "-n", ns)
        table = json.loads(cm["data"]["hccl.json"])
        return table if table["status"] == "completed" else None

    table = wait_for("a completed rank table", completed, timeout_s=60)
    assert [d["rank_id"] for d in table["server_list"][0]["device"]] == [str(i) for i in range(8)]
    wait_for("phase Ready", lambda: _phase_is(cluster, ns, "npu", "Ready"), timeout_s=90)
    cluster.kubectl("delete", "dsv4", "npu", "-n", ns, "--wait=true")


def test_pod_larger_than_any_node_degrades_the_deployment(k8s_cluster, operator, namespace) -> None:
    cluster, ns = k8s_cluster, namespace
    cr = _npu_cr(
        "huge",
        prefill={"npusPerNode": 16, "parallelism": {"tp": 16}},
        decode={"npusPerNode": 16, "parallelism": {"tp": 16}},
    )
    apply_yaml(cluster, json.dumps(cr), ns)
    st = wait_for(
        "phase Degraded", lambda: _phase_is(cluster, ns, "huge", "Degraded"), timeout_s=90
    )
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "Unschedulable"
    assert "huawei.com/Ascend910" in degraded["message"]
    assert any(e["reason"] == "Degraded" for e in warning_events(cluster, ns, "huge"))
    cluster.kubectl("delete", "dsv4", "huge", "-n", ns, "--wait=true")


def _settled(read: Any, quiet_s: float = 2.0) -> float:
    """A counter's value once it has not moved for ``quiet_s`` (syncs already queued finish)."""
    value = read()
    for _ in range(30):
        time.sleep(quiet_s)
        now = read()
        if now == value:
            return float(now)
        value = now
    raise AssertionError(f"the counter kept moving: {value}")


def test_two_replicas_elect_one_active(
    k8s_cluster, operator, operator_kubeconfig, namespace
) -> None:
    cluster, ns = k8s_cluster, namespace
    high = OperatorService(
        operator_kubeconfig, cluster.log_dir, extra=("--priority", "100")
    ).launch()
    try:
        wait_for(
            "the low-priority replica to pause",
            lambda: "Pausing operations in favour of" in operator.tail(400),
            timeout_s=60,
        )
        idle_syncs = _settled(lambda: operator.metric("dsv4_operator_syncs_total"))
        apply_yaml(cluster, (EXAMPLES / "tiny-cpu.yaml").read_text(), ns)
        wait_for(
            "Ready under the active replica",
            lambda: _phase_is(cluster, ns, "tiny", "Ready"),
            timeout_s=120,
        )
        assert high.metric("dsv4_operator_syncs_total") > 0
        assert operator.metric("dsv4_operator_syncs_total") == idle_syncs
    finally:
        high.stop()
    wait_for(
        "the standby to resume", lambda: "Resuming operations" in operator.tail(400), timeout_s=90
    )
    cluster.kubectl(
        "patch",
        "dsv4",
        "tiny",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"decode":{"instances":2}}}',
    )
    wait_for(
        "decode 2/2 under the resumed replica",
        lambda: _status(cluster, ns, "tiny").get("decode", {}).get("summary") == "2/2",
        timeout_s=120,
    )
    assert operator.metric("dsv4_operator_syncs_total") > idle_syncs
    cluster.kubectl("delete", "dsv4", "tiny", "-n", ns, "--wait=true")


LWS_CRD = {
    # A minimal stand-in for LeaderWorkerSet's CRD (its controller is not needed to see what the
    # operator creates): same group, version, kind and plural.
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
    "spec": {
        "group": "leaderworkerset.x-k8s.io",
        "scope": "Namespaced",
        "names": {
            "kind": "LeaderWorkerSet",
            "plural": "leaderworkersets",
            "singular": "leaderworkerset",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
                "subresources": {"status": {}},
            }
        ],
    },
}


def test_leaderworkerset_only_when_its_crd_is_installed(k8s_cluster, operator, namespace) -> None:
    cluster, ns = k8s_cluster, namespace
    cr = _npu_cr(
        "lws",
        prefill={"nodesPerInstance": 2, "parallelism": {"tp": 8, "dp": 2}},
        scheduling={"workload": "LeaderWorkerSet"},
    )
    apply_yaml(cluster, json.dumps(cr), ns)
    st = wait_for("Degraded without the LWS CRD", lambda: _phase_is(cluster, ns, "lws", "Degraded"))
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "LeaderWorkerSet CRD" in degraded["message"]

    cluster.kubectl("apply", "-f", "-", input=json.dumps(LWS_CRD))
    try:
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/leaderworkersets.leaderworkerset.x-k8s.io"
        )

        def lws_objects() -> list[dict[str, Any]] | None:
            items = kubectl_json(cluster, "get", "leaderworkersets", "-n", ns)["items"]
            return items if len(items) == 2 else None

        items = wait_for("a LeaderWorkerSet per role", lws_objects, timeout_s=60)
        prefill = next(o for o in items if o["metadata"]["name"] == "lws-prefill")
        assert prefill["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert prefill["metadata"]["ownerReferences"][0]["name"] == "lws"
        wait_for(
            "no longer Degraded", lambda: _status(cluster, ns, "lws").get("phase") == "Progressing"
        )
        assert not kubectl_json(cluster, "get", "statefulsets", "-n", ns)["items"]
        cluster.kubectl("delete", "dsv4", "lws", "-n", ns, "--wait=true")
    finally:
        cluster.kubectl("delete", "crd", "leaderworkersets.leaderworkerset.x-k8s.io", "--wait=true")


def test_objects_it_does_not_own_are_never_adopted(k8s_cluster, operator, namespace) -> None:
    cluster, ns = k8s_cluster, namespace
    cluster.kubectl("create", "configmap", "mine-engine", "-n", ns, "--from-literal=owner=user")
    apply_yaml(cluster, json.dumps(_npu_cr("mine", prefill={"parallelism": {"tp": 8}})), ns)
    st = wait_for(
        "Degraded because of the foreign ConfigMap",
        lambda: _phase_is(cluster, ns, "mine", "Degraded"),
    )
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidChild"
    assert "ConfigMap mine-engine already exists and is not owned" in degraded["message"]
    cm = kubectl_json(cluster, "get", "configmap", "mine-engine", "-n", ns)
    assert cm["data"] == {"owner": "user"} and not cm["metadata"].get("ownerReferences")
    # a deleted child the operator does own (a Secret) comes back
    wait_for("the KV secret", lambda: "Secret/mine-kv-auth" in _children(cluster, ns, "mine"))
    cluster.kubectl("delete", "secret", "mine-kv-auth", "-n", ns)
    wait_for(
        "the KV secret recreated", lambda: "Secret/mine-kv-auth" in _children(cluster, ns, "mine")
    )
    cluster.kubectl("delete", "dsv4", "mine", "-n", ns, "--wait=true")
    wait_for("children collected", lambda: not _children(cluster, ns, "mine"), timeout_s=60)
    assert kubectl_json(cluster, "get", "configmap", "mine-engine", "-n", ns)["data"] == {
        "owner": "user"
    }
