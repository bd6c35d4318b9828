"""The deployment's ``scheduling`` section: where engine pods go and as which workload kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dsv4_operator.api import DEFAULT_NPU_RESOURCE
from dsv4_operator.api.fields import crd_object, prop
from dsv4_operator.api.schema import opaque, string, string_map

Workload = Literal["StatefulSet", "LeaderWorkerSet"]


@crd_object(defaulted=True)
@dataclass(frozen=True, kw_only=True)
class SchedulingSpec:
    npu_resource: str = prop(
        string(
            "Extended resource of the NPU device plugin.",
            default=DEFAULT_NPU_RESOURCE,
            pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
            max_length=253,
        ),
        key="npuResourceName",
    )
    workload: Workload = prop(
        string(
            "Workload kind for multi-node instances.",
            default="StatefulSet",
            enum=["StatefulSet", "LeaderWorkerSet"],
        )
    )
    node_selector: dict[str, str] = prop(string_map("Node labels engine pods require."))
    tolerations: list[dict[str, Any]] = prop(opaque("Tolerations for engine pods.", array=True))
    affinity: dict[str, Any] = prop(opaque("Affinity for engine pods."))
    topology_spread_constraints: list[dict[str, Any]] = prop(
        opaque("Topology spread for engine pods.", array=True)
    )
    priority_class_name: str | None = prop(string("Priority class of engine pods.", max_length=253))

    @property
    def use_lws(self) -> bool:
        return self.workload == "LeaderWorkerSet"
