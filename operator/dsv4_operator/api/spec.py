"""Typed view of a DeepSeekV4Deployment, built from the object after the CRD's defaults apply.

``apply_defaults`` walks the same schema the API server uses, so a spec built from a partial dict
in a unit test is the spec the operator sees in a cluster. Every section is a frozen dataclass:
the rest of the operator reads attributes, never string keys.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

from dsv4_common.ports import sidecar_control_port, sidecar_metrics_port
from dsv4_operator.api.crd import spec_schema
from dsv4_operator.api.schema import Schema

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")
Workload = Literal["StatefulSet", "LeaderWorkerSet"]


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

    @property
    def ranks_per_node(self) -> int:
        """Rank processes in each pod of an instance: one per NPU, or on CPU the tp x dp ranks
        split evenly over the pods (the CRD refuses a split that is not even)."""
        par = self.parallelism
        return par.tp * par.dp // self.nodes_per_instance


@dataclass(frozen=True)
class ModelSpec:
    served_name: str
    architecture: str | None
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
class KVTransferSpec:
    transport: str
    port: int
    """The sidecar's peer port; its control API and metrics ports derive from it."""
    lease_seconds: int
    failure_policy: str
    pull_timeout_s: int
    sidecar_image: str | None = None
    sidecar_resources: dict[str, Any] = field(default_factory=dict)

    @property
    def control_port(self) -> int:
        return sidecar_control_port(self.port)

    @property
    def metrics_port(self) -> int:
        return sidecar_metrics_port(self.port)


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class GatewaySpec:
    replicas: int
    image: str
    routing_policy: str
    service_type: str
    port: int
    api_key_secret: SecretKeyRef | None = None
    resources: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Bounds:
    min: int
    max: int


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``; ``autoscaling.from_spec.policy_of`` turns it into the core's Policy."""

    enabled: bool
    ttft_seconds: float
    tpot_seconds: float
    prefill: Bounds
    decode: Bounds
    mode: str = "Builtin"
    interval_s: int = 15
    window_s: int = 60
    stabilization_s: int = 300
    drain_timeout_s: int = 600
    source: str = "Gateway"
    prometheus_url: str | None = None
    prefill_tokens_per_s: float | None = None
    waiting_per_instance: float = 2.0
    prompt_deadline_s: float | None = None
    """The prefill engines' ``--prompt-deadline`` (SLO-aware prompt order); None: FCFS."""
    running_per_instance: int = 16
    kv_cache_target: float = 0.8
    ratio: tuple[float, float] | None = None
    npu_budget: int | None = None
    scheduled_minimums: tuple[dict[str, Any], ...] = ()
    """``scheduledMinimums`` as written (``autoscaling.schedule`` reads the windows)."""

    def bounds(self, role: Role) -> Bounds:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class SchedulingSpec:
    npu_resource: str
    workload: Workload
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)
    topology_spread_constraints: list[dict[str, Any]] = field(default_factory=list)
    priority_class_name: str | None = None

    @property
    def use_lws(self) -> bool:
        return self.workload == "LeaderWorkerSet"


@dataclass(frozen=True)
class EplbSpec:
    enabled: bool
    redundant_experts: int
    interval_steps: int
    window_steps: int = 600


@dataclass(frozen=True)
class HccnConfSpec:
    enabled: bool
    host_path: str


@dataclass(frozen=True)
class FeaturesSpec:
    """``eplb`` becomes the engines' EPLB settings (engine.json); ``mlapo`` and ``c8`` are
    accepted by the CRD only at their defaults (no engine acts on them yet); ``hccn_conf`` and
    ``privileged`` shape the engine pods."""

    eplb: EplbSpec
    mlapo: bool
    c8: str
    hccn_conf: HccnConfSpec
    privileged: bool


@dataclass(frozen=True)
class ObservabilitySpec:
    otlp_endpoint: str | None = None  # request traces (--otlp-traces-endpoint); None: off


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
    kv: KVTransferSpec
    gateway: GatewaySpec
    autoscaling: AutoscalingSpec
    scheduling: SchedulingSpec
    features: FeaturesSpec
    labels: dict[str, str] = field(default_factory=dict)
    observability: ObservabilitySpec = field(default_factory=ObservabilitySpec)

    def role(self, role: Role) -> RoleSpec:
        return self.prefill if role == "prefill" else self.decode

    @property
    def sidecar_image(self) -> str:
        return self.kv.sidecar_image or self.image


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


def _kv(raw: dict[str, Any]) -> KVTransferSpec:
    return KVTransferSpec(
        transport=raw["transport"],
        port=int(raw["port"]),
        lease_seconds=int(raw["leaseSeconds"]),
        failure_policy=raw["failurePolicy"],
        pull_timeout_s=int(raw["pullTimeoutSeconds"]),
        sidecar_image=raw.get("sidecarImage"),
        sidecar_resources=dict(raw.get("sidecarResources") or {}),
    )


def _gateway(raw: dict[str, Any]) -> GatewaySpec:
    secret = raw.get("apiKeySecret")
    return GatewaySpec(
        replicas=int(raw["replicas"]),
        image=raw["image"],
        routing_policy=raw["routingPolicy"],
        service_type=raw["serviceType"],
        port=int(raw["port"]),
        api_key_secret=SecretKeyRef(secret["name"], secret["key"]) if secret else None,
        resources=dict(raw.get("resources") or {}),
    )


def _autoscaling(raw: dict[str, Any]) -> AutoscalingSpec:
    def bounds(b: dict[str, Any]) -> Bounds:
        return Bounds(min=int(b["min"]), max=int(b["max"]))

    p, d, metrics = raw["prefill"], raw["decode"], raw["metrics"]
    ratio = raw.get("prefillDecodeRatio")
    tps = p.get("tokensPerSecond")
    return AutoscalingSpec(
        enabled=bool(raw["enabled"]),
        ttft_seconds=float(raw["ttftSeconds"]),
        tpot_seconds=float(raw["tpotSeconds"]),
        prefill=bounds(p),
        decode=bounds(d),
        mode=raw["mode"],
        interval_s=int(raw["intervalSeconds"]),
        window_s=int(raw["windowSeconds"]),
        stabilization_s=int(raw["scaleDownStabilizationSeconds"]),
        drain_timeout_s=int(raw["drainTimeoutSeconds"]),
        source=metrics["source"],
        prometheus_url=metrics.get("prometheusURL"),
        prefill_tokens_per_s=float(tps) if tps is not None else None,
        waiting_per_instance=float(p["waitingPerInstance"]),
        prompt_deadline_s=float(dl) if (dl := p.get("promptDeadlineSeconds")) is not None else None,
        running_per_instance=int(d["runningPerInstance"]),
        kv_cache_target=float(d["kvCacheTarget"]),
        ratio=(float(ratio["min"]), float(ratio["max"])) if ratio else None,
        npu_budget=int(raw["npuBudget"]) if raw.get("npuBudget") is not None else None,
        scheduled_minimums=tuple(copy.deepcopy(w) for w in raw.get("scheduledMinimums") or ()),
    )


def _scheduling(raw: dict[str, Any]) -> SchedulingSpec:
    return SchedulingSpec(
        npu_resource=raw["npuResourceName"],
        workload=raw["workload"],
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=list(raw.get("tolerations") or []),
        affinity=dict(raw.get("affinity") or {}),
        topology_spread_constraints=list(raw.get("topologySpreadConstraints") or []),
        priority_class_name=raw.get("priorityClassName"),
    )


def _features(raw: dict[str, Any]) -> FeaturesSpec:
    eplb, hccn = raw["eplb"], raw["hccnConf"]
    return FeaturesSpec(
        eplb=EplbSpec(
            enabled=bool(eplb["enabled"]),
            redundant_experts=int(eplb["redundantExperts"]),
            interval_steps=int(eplb["intervalSteps"]),
            window_steps=int(eplb.get("windowSteps", 600)),
        ),
        mlapo=bool(raw["mlapo"]),
        c8=raw["c8"],
        hccn_conf=HccnConfSpec(enabled=bool(hccn["enabled"]), host_path=hccn["hostPath"]),
        privileged=bool(raw["privileged"]),
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
            architecture=model.get("architecture"),
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
        kv=_kv(spec["kvTransfer"]),
        gateway=_gateway(spec["gateway"]),
        autoscaling=_autoscaling(spec["autoscaling"]),
        scheduling=_scheduling(spec["scheduling"]),
        features=_features(spec["features"]),
        labels=dict(meta.get("labels") or {}),
        observability=ObservabilitySpec(
            otlp_endpoint=(spec["observability"]["tracing"].get("otlpEndpoint") or None)
        ),
    )
