"""desired_children as a pure function: names, ownership, pods, rank tables, LWS, determinism."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from dsv4_operator.api.spec import DeploymentSpec, KVTransferSpec, parse
from dsv4_operator.reconcile import Facts, desired_children
from dsv4_operator.reconcile.desired import ReconcileError
from dsv4_operator.reconcile.ranktable import PodPlacement, parse_devices, rank_table

from .conftest import make_cr

NPU = "huawei.com/Ascend910"


def _by_kind(objs: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o["metadata"]["name"])
    return out


def _engine(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


def test_defaults_fill_a_minimal_spec() -> None:
    spec = parse(make_cr())
    assert spec.prefill.parallelism.tp == 8 and spec.prefill.parallelism.ep == 8
    assert spec.kv == KVTransferSpec(
        transport="hccl",
        port=14579,
        lease_seconds=30,
        failure_policy="recompute",
        pull_timeout_s=30,
    )
    assert (spec.kv.control_port, spec.kv.metrics_port) == (14580, 14581)
    assert spec.scheduling.npu_resource == NPU and not spec.scheduling.use_lws
    assert spec.features.eplb.interval_steps == 600 and spec.features.hccn_conf.enabled
    assert spec.gateway.routing_policy == "dplb" and spec.gateway.api_key_secret is None
    assert spec.autoscaling.enabled is False and spec.autoscaling.decode.max == 4


def test_npu_deployment_children(npu_spec: DeploymentSpec) -> None:
    objs = desired_children(npu_spec, Facts(kv_token="t"))
    kinds = _by_kind(objs)
    assert kinds["StatefulSet"] == ["v4-prefill-0", "v4-prefill-1", "v4-decode-0"]
    assert sorted(kinds["ConfigMap"]) == sorted(
        ["v4-engine", "v4-prefill-0-ranktable", "v4-prefill-1-ranktable", "v4-decode-0-ranktable"]
    )
    assert sorted(kinds["Service"]) == ["v4-decode", "v4-gateway", "v4-prefill"]
    assert kinds["Deployment"] == ["v4-gateway"]
    assert kinds["Secret"] == ["v4-kv-auth"]
    assert set(kinds) >= {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    for o in objs:
        ref = o["metadata"]["ownerReferences"][0]
        assert ref["uid"] == "uid-1" and ref["controller"] is True
        assert o["metadata"]["namespace"] == "ml"
        assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "dsv4-operator"


def test_multi_node_instance_statefulset(npu_spec: DeploymentSpec) -> None:
    sts = next(
        o
        for o in desired_children(npu_spec, Facts(kv_token="t"))
        if o["metadata"]["name"] == "v4-prefill-1"
    )
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["serviceName"] == "v4-prefill"
    assert sts["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/instance": "v4",
        "serving.dsv4.io/role": "prefill",
        "serving.dsv4.io/instance": "1",
    }
    engine = _engine(sts)
    assert engine["resources"]["limits"][NPU] == "8"
    cmd = engine["command"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "8"
    assert cmd[cmd.index("--data-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--role") + 1] == "prefill"
    assert "--kv-sidecar" not in cmd  # deployment-wide: in engine.json
    env = {e["name"]: e for e in engine["env"]}
    assert env["DSV4_MASTER_ADDR"]["value"] == "v4-prefill-1-0.v4-prefill"
    assert env["RANK_TABLE_FILE"]["value"] == "/etc/dsv4/ranktable/hccl.json"
    assert "pod-index" in env["DSV4_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]


def test_engine_pod_shares_memory_shm_with_sidecar_and_mounts_hccn(
    npu_spec: DeploymentSpec,
) -> None:
    sts = next(
        o for o in desired_children(npu_spec, Facts(kv_token="t")) if o["kind"] == "StatefulSet"
    )
    pod = sts["spec"]["template"]["spec"]
    engine, sidecar = pod["containers"]
    assert sidecar["name"] == "kv-sidecar"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["shm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in sidecar["volumeMounts"]
    assert any(m["mountPath"] == "/dev/shm" for m in engine["volumeMounts"])
    assert vols["hccn-conf"]["hostPath"]["path"] == "/etc/hccn.conf"
    assert (
        engine["startupProbe"]["failureThreshold"] * engine["startupProbe"]["periodSeconds"] >= 1800
    )
    assert engine["securityContext"]["runAsNonRoot"] is True
    assert "privileged" not in engine["securityContext"]
    assert pod["terminationGracePeriodSeconds"] == 120


def test_cpu_pods_request_no_npus_and_mount_no_ascend_paths(cpu_spec: DeploymentSpec) -> None:
    objs = desired_children(cpu_spec, Facts(kv_token="t"))
    assert not any(o["metadata"]["name"].endswith("ranktable") for o in objs)
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    engine = _engine(sts)
    assert NPU not in json.dumps(engine["resources"])
    vols = {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert not vols & {"hccn-conf", "ascend-driver", "ranktable"}
    assert engine["command"][engine["command"].index("--device") + 1] == "cpu"
    cm = next(o for o in objs if o["metadata"]["name"] == "v4-engine")
    assert json.loads(cm["data"]["engine.json"])["model"] == "dsv4-tiny"


def test_privileged_is_opt_in() -> None:
    spec = parse(make_cr(features={"privileged": True}))
    sts = next(o for o in desired_children(spec, Facts(kv_token="t")) if o["kind"] == "StatefulSet")
    assert _engine(sts)["securityContext"] == {"privileged": True}


def test_kv_secret_carries_the_observed_token(npu_spec: DeploymentSpec) -> None:
    secret = next(
        o for o in desired_children(npu_spec, Facts(kv_token="s3cret")) if o["kind"] == "Secret"
    )
    assert base64.b64decode(secret["data"]["token"]) == b"s3cret"


def test_scaling_a_role_changes_the_workloads(npu_spec: DeploymentSpec) -> None:
    cr = make_cr(prefill={"instances": 3, "nodesPerInstance": 2, "parallelism": {"tp": 8, "dp": 2}})
    names = _by_kind(desired_children(parse(cr), Facts(kv_token="t")))["StatefulSet"]
    assert names == ["v4-prefill-0", "v4-prefill-1", "v4-prefill-2", "v4-decode-0"]


def test_children_are_deterministic(npu_spec: DeploymentSpec) -> None:
    a = desired_children(npu_spec, Facts(kv_token="t"))
    b = desired_children(npu_spec, Facts(kv_token="t"))
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_lws_requires_its_crd() -> None:
    spec = parse(make_cr(scheduling={"workload": "LeaderWorkerSet"}))
    with pytest.raises(ReconcileError, match="LeaderWorkerSet CRD"):
        desired_children(spec, Facts(kv_token="t"))
    objs = desired_children(spec, Facts(kv_token="t", lws_available=True))
    lws = [o for o in objs if o["kind"] == "LeaderWorkerSet"]
    assert [o["spec"]["replicas"] for o in lws] == [1, 1]
    template = lws[0]["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}

    def field(name: str) -> str:
        return str(env[name]["valueFrom"]["fieldRef"]["fieldPath"])

    assert field("DSV4_INSTANCE") == "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"
    assert field("DSV4_NODE_RANK") == "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
    assert field("DSV4_MASTER_ADDR") == (
        "metadata.annotations['leaderworkerset.sigs.k8s.io/leader-name']"
    )
    assert "value" not in env["DSV4_MASTER_ADDR"] and "value" not in env["DSV4_INSTANCE"]
    assert env["RANK_TABLE_FILE"]["value"] == "/etc/dsv4/ranktable/hccl-$(DSV4_INSTANCE).json"
    assert "serving.dsv4.io/instance" not in template["metadata"]["labels"]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["ranktable"]["configMap"]["name"] == "v4-prefill-ranktables"


def _devices(n: int, base: int) -> str:
    return json.dumps(
        {"devices": [{"device_id": str(i), "device_ip": f"192.168.{base}.{i}"} for i in range(n)]}
    )


def test_rank_table_waits_for_every_pod() -> None:
    pods = [PodPlacement("p-0", 0, "node-a", "10.0.0.1", _devices(8, 1))]
    assert rank_table(pods, nodes_per_instance=2, npus_per_node=8)["status"] == "initializing"
    pods.append(PodPlacement("p-1", 1, "node-b", "10.0.0.2", None))
    assert rank_table(pods, 2, 8)["status"] == "initializing"


def test_rank_table_completed_numbers_ranks_by_node_rank() -> None:
    pods = [
        PodPlacement("p-1", 1, "node-b", "10.0.0.2", _devices(8, 2)),
        PodPlacement("p-0", 0, "node-a", "10.0.0.1", _devices(8, 1)),
    ]
    table = rank_table(pods, 2, 8)
    assert table["status"] == "completed" and table["server_count"] == "2"
    assert [s["server_id"] for s in table["server_list"]] == ["10.0.0.1", "10.0.0.2"]
    ranks = [d["rank_id"] for s in table["server_list"] for d in s["device"]]
    assert ranks == [str(i) for i in range(16)]
    assert table["server_list"][1]["device"][0] == {
        "device_id": "0",
        "device_ip": "192.168.2.0",
        "rank_id": "8",
    }


def test_rank_table_rejects_wrong_device_count() -> None:
    pods = [PodPlacement("p-0", 0, "n", "10.0.0.1", _devices(4, 1))]
    with pytest.raises(ReconcileError, match="got 4 NPUs") as e:
        rank_table(pods, 1, 8)
    assert e.value.reason == "InvalidPlacement"


def test_malformed_device_annotation_is_named() -> None:
    with pytest.raises(ReconcileError, match="devices"):
        parse_devices('{"foo": 1}')
    with pytest.raises(ReconcileError, match="device_ip"):
        parse_devices('{"devices": [{"device_id": "0"}]}')
    with pytest.raises(ReconcileError, match="not JSON"):
        parse_devices("{")


def test_completed_rank_table_lands_in_the_configmap(npu_spec: DeploymentSpec) -> None:
    facts = Facts(
        kv_token="t",
        placements={
            ("decode", 0): [PodPlacement("v4-decode-0-0", 0, "n", "10.0.0.9", _devices(8, 9))]
        },
    )
    cm = next(
        o
        for o in desired_children(npu_spec, facts)
        if o["metadata"]["name"] == "v4-decode-0-ranktable"
    )
    assert json.loads(cm["data"]["hccl.json"])["status"] == "completed"
