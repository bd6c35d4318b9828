"""How an engine pod learns its instance and its node rank, per workload kind.

A StatefulSet is one instance: its pods' index is the node rank. A LeaderWorkerSet is one role:
the group index is the instance, the worker index the node rank, and the pod template is shared
by every group, so the instance comes from a label and the rank tables are one ConfigMap per role
with a key per instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4_operator.api.spec import DeploymentSpec, RoleSpec
from dsv4_operator.reconcile import names

RANKTABLE_DIR = "/etc/dsv4/ranktable"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_LEADER_NAME = "leaderworkerset.sigs.k8s.io/leader-name"
STS_POD_INDEX = "apps.kubernetes.io/pod-index"


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


@dataclass(frozen=True)
class StatefulSetIdentity:
    instance: int

    def labels(self, spec: DeploymentSpec, role: RoleSpec) -> dict[str, str]:
        return names.instance_labels(spec, role.role, self.instance)

    def ranktable_configmap(self, spec: DeploymentSpec, role: RoleSpec) -> str:
        return names.ranktable_name(spec, role.role, self.instance)

    def env(self, spec: DeploymentSpec, role: RoleSpec) -> list[dict[str, Any]]:
        return [
            _field("DSV4_NODE_RANK", f"metadata.labels['{STS_POD_INDEX}']"),
            _value("DSV4_INSTANCE", str(self.instance)),
            _value("DSV4_NODES_PER_INSTANCE", str(role.nodes_per_instance)),
            # node rank 0 hosts torch.distributed's rendezvous for multi-node instances
            _value("DSV4_MASTER_ADDR", names.leader_address(spec, role.role, self.instance)),
            _value("RANK_TABLE_FILE", f"{RANKTABLE_DIR}/hccl.json"),
        ]


@dataclass(frozen=True)
class LeaderWorkerSetIdentity:
    def labels(self, spec: DeploymentSpec, role: RoleSpec) -> dict[str, str]:
        return names.role_labels(spec, role.role)

    def ranktable_configmap(self, spec: DeploymentSpec, role: RoleSpec) -> str:
        return names.ranktables_name(spec, role.role)

    def env(self, spec: DeploymentSpec, role: RoleSpec) -> list[dict[str, Any]]:
        return [
            _field("DSV4_NODE_RANK", f"metadata.labels['{LWS_WORKER_INDEX}']"),
            _field("DSV4_INSTANCE", f"metadata.labels['{LWS_GROUP_INDEX}']"),
            _value("DSV4_NODES_PER_INSTANCE", str(role.nodes_per_instance)),
            _field("DSV4_MASTER_ADDR", f"metadata.annotations['{LWS_LEADER_NAME}']"),
            # DSV4_INSTANCE is defined above, so the kubelet expands it here
            _value("RANK_TABLE_FILE", f"{RANKTABLE_DIR}/hccl-$(DSV4_INSTANCE).json"),
        ]


Identity = StatefulSetIdentity | LeaderWorkerSetIdentity
