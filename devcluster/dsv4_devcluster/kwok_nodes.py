"""Fake Ascend nodes for kwok: Node objects that kwok keeps Ready and whose pods it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# kwok manages only nodes carrying this annotation (see the --manage-nodes-* flags in cluster.py).
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"


@dataclass(frozen=True)
class FakeNodeSpec:
    """What each fake node advertises; the defaults model one Atlas 800 A2 server."""

    npu_resource: str = "huawei.com/Ascend910"
    npus: int = 8
    cpu: str = "192"
    memory: str = "1536Gi"
    pods: int = 110
    accelerator_type: str = "module-910b-8"
    labels: dict[str, str] = field(default_factory=dict)


def fake_node(name: str, spec: FakeNodeSpec) -> dict[str, Any]:
    """The Node of one fake Ascend server; capacity is set at creation, as a kubelet does."""
    capacity = {
        "cpu": spec.cpu,
        "memory": spec.memory,
        "pods": str(spec.pods),
        spec.npu_resource: str(spec.npus),
    }
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        # Labels the Ascend device plugin and node feature discovery put on NPU servers.
        "accelerator": "huawei-Ascend910",
        "accelerator-type": spec.accelerator_type,
        "node.kubernetes.io/npu.chip.name": "910B",
        **spec.labels,
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {
                KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE,
                "node.alpha.kubernetes.io/ttl": "0",
            },
        },
        "spec": {},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "fake",
                "kubeProxyVersion": "fake",
                "containerRuntimeVersion": "kwok",
                "osImage": "kwok",
                "kernelVersion": "kwok",
                "machineID": name,
                "systemUUID": name,
                "bootID": name,
            },
            "phase": "Running",
        },
    }
