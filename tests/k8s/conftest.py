from __future__ import annotations

import uuid
from collections.abc import Iterator

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


@pytest.fixture(scope="session")
def dsv4_crd(k8s_control_plane):  # type: ignore[no-untyped-def]
    """The DeepSeekV4Deployment CRD, installed from its single source and Established."""
    import json

    from dsv4_operator.api.crd import crd

    k8s_control_plane.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd()))
    k8s_control_plane.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/deepseekv4deployments.serving.dsv4.io",
    )
    return crd()


@pytest.fixture(scope="module")
def operator(k8s_cluster, dsv4_crd):  # type: ignore[no-untyped-def]
    """A running `dsv4 operator` process (standalone), stopped after the module."""
    from tests.k8s.operator_fixtures import OperatorProcess

    proc = OperatorProcess(k8s_cluster.kubeconfig, k8s_cluster.log_dir).start()
    yield proc
    proc.stop()
