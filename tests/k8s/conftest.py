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
