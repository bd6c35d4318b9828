from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config


@pytest.fixture(scope="session")
def api_client(k8s_control_plane) -> client.ApiClient:  # type: ignore[no-untyped-def]
    return config.new_client_from_config(config_file=str(k8s_control_plane.kubeconfig))


@pytest.fixture
def namespace(api_client: client.ApiClient) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


REPO = Path(__file__).resolve().parents[2]
RELEASE_NAMESPACE = "dsv4-system"


def helm(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return cluster.helm(*args)  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def helm_release(k8s_control_plane):  # type: ignore[no-untyped-def]
    """`helm install` of charts/dsv4: CRDs, operator Deployment, RBAC, peering object."""
    res = helm(
        k8s_control_plane,
        "install",
        "dsv4",
        str(REPO / "charts" / "dsv4"),
        "--namespace",
        RELEASE_NAMESPACE,
        "--create-namespace",
    )
    assert res.returncode == 0, res.stderr
    k8s_control_plane.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/deepseekv4deployments.serving.dsv4.io",
    )
    return res.stdout


@pytest.fixture(scope="session")
def dsv4_crd(helm_release):  # type: ignore[no-untyped-def]
    """The DeepSeekV4Deployment CRD, installed by the chart."""
    from dsv4_operator.api.crd import crd

    return crd()


@pytest.fixture(scope="session")
def operator_kubeconfig(k8s_cluster, helm_release) -> Path:  # type: ignore[no-untyped-def]
    """Credentials of the chart's operator ServiceAccount: the operator runs with exactly its RBAC."""
    return k8s_cluster.service_account_kubeconfig(RELEASE_NAMESPACE, "dsv4-operator")


@pytest.fixture(scope="module")
def operator(k8s_cluster, operator_kubeconfig):  # type: ignore[no-untyped-def]
    """A running `dsv4 operator` process with the chart's RBAC and peering, stopped after the module."""
    from dsv4_devcluster.operator_process import OperatorService

    proc = OperatorService(operator_kubeconfig, k8s_cluster.log_dir).launch()
    yield proc
    proc.stop()
