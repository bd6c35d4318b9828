"""The local control plane is a real Kubernetes: scheduling, kwok nodes, GC, kubectl, helm."""

from __future__ import annotations

import json
import subprocess

from kubernetes import client

from tests.helpers import wait_for

NPU = "huawei.com/Ascend910"


def _pod_spec(npus: int) -> client.V1PodSpec:
    return client.V1PodSpec(
        containers=[
            client.V1Container(
                name="engine",
                image="dsv4/engine:test",
                resources=client.V1ResourceRequirements(
                    requests={NPU: str(npus)}, limits={NPU: str(npus)}
                ),
            )
        ],
    )


def test_apiserver_reports_real_version(k8s_control_plane) -> None:
    info = json.loads(k8s_control_plane.kubectl("version", "-o", "json"))
    assert info["serverVersion"]["gitVersion"].startswith("v1.3")
    assert int(info["serverVersion"]["minor"].rstrip("+")) >= 34
    assert info["clientVersion"]["gitVersion"] == info["serverVersion"]["gitVersion"]


def test_rbac_denies_unbound_user(k8s_control_plane) -> None:
    # Impersonation goes through the same authorizer as a real user: RBAC is on.
    out = k8s_control_plane.kubectl("auth", "can-i", "list", "pods", "--as=nobody", check=False)
    assert out.strip() == "no"
    assert k8s_control_plane.kubectl("auth", "can-i", "list", "pods").strip() == "yes"


def test_fake_nodes_advertise_ascend_npus(k8s_cluster, api_client) -> None:
    nodes = (
        client.CoreV1Api(api_client).list_node(label_selector="accelerator=huawei-Ascend910").items
    )
    assert len(nodes) >= 2
    for node in nodes:
        assert node.status.allocatable[NPU] == "8"
        ready = {c.type: c.status for c in node.status.conditions}["Ready"]
        assert ready == "True"


def test_npu_deployment_is_scheduled_and_running(k8s_cluster, api_client, namespace) -> None:
    labels = {"app": "engine"}
    dep = client.V1Deployment(
        metadata=client.V1ObjectMeta(name="engine"),
        spec=client.V1DeploymentSpec(
            replicas=1,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels), spec=_pod_spec(8)
            ),
        ),
    )
    client.AppsV1Api(api_client).create_namespaced_deployment(namespace, dep)
    core = client.CoreV1Api(api_client)

    def running_pod() -> client.V1Pod | None:
        pods = core.list_namespaced_pod(namespace, label_selector="app=engine").items
        return next((p for p in pods if p.status.phase == "Running"), None)

    pod = wait_for("the NPU pod to run", running_pod)
    assert pod.spec.node_name in k8s_cluster.nodes
    wait_for(
        "the deployment to report 1 available replica",
        lambda: (
            client.AppsV1Api(api_client)
            .read_namespaced_deployment("engine", namespace)
            .status.available_replicas
            == 1
        ),
    )


def test_pod_asking_for_more_npus_than_a_node_has_is_unschedulable(
    k8s_cluster, api_client, namespace
) -> None:
    core = client.CoreV1Api(api_client)
    pod = client.V1Pod(metadata=client.V1ObjectMeta(name="too-big"), spec=_pod_spec(9))
    core.create_namespaced_pod(namespace, pod)

    def unschedulable() -> client.V1PodCondition | None:
        status = core.read_namespaced_pod("too-big", namespace).status
        return next(
            (
                c
                for c in status.conditions or []
                if c.type == "PodScheduled" and c.reason == "Unschedulable"
            ),
            None,
        )

    cond = wait_for("the scheduler to mark the pod Unschedulable", unschedulable)
    assert NPU in cond.message
    pod_now = core.read_namespaced_pod("too-big", namespace)
    assert pod_now.status.phase == "Pending"
    assert pod_now.spec.node_name is None


def test_deleting_owner_garbage_collects_dependents(k8s_cluster, api_client, namespace) -> None:
    core = client.CoreV1Api(api_client)
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    ref = client.V1OwnerReference(
        api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid
    )
    core.create_namespaced_config_map(
        namespace,
        client.V1ConfigMap(metadata=client.V1ObjectMeta(name="dependent", owner_references=[ref])),
    )
    core.delete_namespaced_config_map("owner", namespace)

    def gone() -> bool:
        names = [c.metadata.name for c in core.list_namespaced_config_map(namespace).items]
        return "dependent" not in names

    wait_for("the garbage collector to delete the dependent", gone)


def test_kubectl_apply_creates_and_updates(k8s_control_plane, namespace) -> None:
    manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "applied", "namespace": namespace},
        "data": {"k": "v1"},
    }
    k8s_control_plane.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    manifest["data"] = {"k": "v2"}
    out = k8s_control_plane.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    assert "configured" in out
    got = json.loads(
        k8s_control_plane.kubectl("get", "cm", "applied", "-n", namespace, "-o", "json")
    )
    assert got["data"] == {"k": "v2"}


def test_helm_talks_to_the_cluster(k8s_control_plane, namespace) -> None:
    helm = str(k8s_control_plane.config.bin_dir / "helm")
    env = {
        "KUBECONFIG": str(k8s_control_plane.kubeconfig),
        "HOME": str(k8s_control_plane.work_dir),
        "PATH": "/usr/bin:/bin",
    }
    version = subprocess.run(
        [helm, "version", "--short"], capture_output=True, text=True, env=env, check=True
    )
    assert version.stdout.startswith("v3.")
    listed = subprocess.run(
        [helm, "list", "-n", namespace, "-o", "json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert json.loads(listed.stdout) == []
