"""Typed view of a DeepSeekV4Deployment, built from the object after the CRD's defaults apply.

``apply_defaults`` walks the same schema the API server uses, so a spec built from a partial dict
in a unit test is the spec the operator sees in a cluster.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

from dsv4_operator.api.crd import spec_schema
from dsv4_operator.api.schema import Schema

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")


def apply_defaults(schema: Schema, value: Any) -> Any:
    """Structural defaulting as the API server does it: fill absent fields that have defaults."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    out = copy.deepcopy(value)
    for name, prop in schema.get("properties", {}).items():
        if name not in out and "default" in prop:
            out[name] = copy.deepcopy(prop["default"])
        if name in out:
            out[name] = apply_defaults(prop, out[name])
    return out


@dataclass(frozen=True)
class Parallelism:
    tp: int
    dp: int
    ep: int

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class RoleSpec:
    role: Role
    instances: int
    nodes_per_instance: int
    npus_per_node: int
    parallelism: Parallelism
    mtp_tokens: int
    engine_args: list[str]
    env: dict[str, str]
    resources: dict[str, Any]
    shm_size: str
    startup_timeout_s: int
    termination_grace_s: int

    @property
    def on_npu(self) -> bool:
        return self.npus_per_node > 0


@dataclass(frozen=True)
class ModelSpec:
    served_name: str
    architecture: str
    dtype: str
    quantization: str
    max_model_len: int
    path: str | None = None
    pvc_claim: str | None = None
    pvc_sub_path: str = ""
    preset: str | None = None

    @property
    def engine_model_arg(self) -> str:
        """What the engine's --model gets: a preset name or the mount path of the checkpoint."""
        if self.preset:
            return self.preset
        if self.path:
            return self.path
        return "/models/checkpoint"


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    namespace: str
    uid: str
    generation: int
    model: ModelSpec
    image: str
    image_pull_policy: str
    image_pull_secrets: list[str]
    prefill: RoleSpec
    decode: RoleSpec
    kv: dict[str, Any]
    gateway: dict[str, Any]
    autoscaling: dict[str, Any]
    scheduling: dict[str, Any]
    features: dict[str, Any]
    labels: dict[str, str] = field(default_factory=dict)

    def role(self, role: Role) -> RoleSpec:
        return self.prefill if role == "prefill" else self.decode

    @property
    def npu_resource(self) -> str:
        return str(self.scheduling["npuResourceName"])

    @property
    def sidecar_image(self) -> str:
        return str(self.kv.get("sidecarImage") or self.image)

    @property
    def gateway_image(self) -> str:
        return str(self.gateway["image"])


def _role(role: Role, raw: dict[str, Any]) -> RoleSpec:
    par = raw["parallelism"]
    tp, dp = int(par["tp"]), int(par["dp"])
    return RoleSpec(
        role=role,
        instances=int(raw["instances"]),
        nodes_per_instance=int(raw["nodesPerInstance"]),
        npus_per_node=int(raw["npusPerNode"]),
        parallelism=Parallelism(tp=tp, dp=dp, ep=int(par.get("ep") or tp * dp)),
        mtp_tokens=int(raw["mtpTokens"]),
        engine_args=list(raw.get("engineArgs") or []),
        env=dict(raw.get("env") or {}),
        resources=dict(raw.get("resources") or {}),
        shm_size=str(raw["shmSize"]),
        startup_timeout_s=int(raw["startupTimeoutSeconds"]),
        termination_grace_s=int(raw["terminationGracePeriodSeconds"]),
    )


def parse(body: dict[str, Any]) -> DeploymentSpec:
    """A DeploymentSpec from a DeepSeekV4Deployment object (dict as read from the API)."""
    meta = body["metadata"]
    spec = apply_defaults(spec_schema(), body.get("spec") or {})
    model = spec["model"]
    pvc = model.get("pvc") or {}
    engine = spec["engine"]
    return DeploymentSpec(
        name=meta["name"],
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation", 0)),
        model=ModelSpec(
            served_name=model["servedName"],
            architecture=model["architecture"],
            dtype=model["dtype"],
            quantization=model["quantization"],
            max_model_len=int(model["maxModelLen"]),
            path=model.get("path"),
            pvc_claim=pvc.get("claimName"),
            pvc_sub_path=pvc.get("subPath", ""),
            preset=model.get("preset"),
        ),
        image=engine["image"],
        image_pull_policy=engine["imagePullPolicy"],
        image_pull_secrets=list(engine.get("imagePullSecrets") or []),
        prefill=_role("prefill", spec["prefill"]),
        decode=_role("decode", spec["decode"]),
        kv=spec["kvTransfer"],
        gateway=spec["gateway"],
        autoscaling=spec["autoscaling"],
        scheduling=spec["scheduling"],
        features=spec["features"],
        labels=dict(meta.get("labels") or {}),
    )
