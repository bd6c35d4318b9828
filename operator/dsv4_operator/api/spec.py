"""The DeepSeekV4Deployment's spec: each field declared once, read as the CRD's schema and as a
typed view of the object (``api.fields``).

Every section is a frozen dataclass whose fields carry their OpenAPI schema (description,
default, validation) and whose ``crd_object`` carries the CEL rules that span fields (messages
written for the person who made the mistake). ``spec_schema`` is what the CRD serves;
``parse`` builds the typed spec from an object after the CRD's defaults apply
(``apply_defaults`` walks the same schema the API server uses, so a spec built from a partial
dict in a unit test is the spec the operator sees in a cluster). The rest of the operator reads
attributes, never string keys.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from dsv4_common.ports import (
    KV_PORT,
    SIDECAR_CONTROL_OFFSET,
    SIDECAR_METRICS_OFFSET,
    sidecar_control_port,
    sidecar_metrics_port,
)
from dsv4_operator.api.autoscaling_spec import AutoscalingSpec
from dsv4_operator.api.features_spec import FeaturesSpec
from dsv4_operator.api.fields import (
    crd_object,
    from_crd,
    not_yet,
    object_schema,
    place,
    prop,
    section,
)
from dsv4_operator.api.observability_spec import ObservabilitySpec
from dsv4_operator.api.parallelism_spec import RANKS_CEL, Parallelism, cp_rules
from dsv4_operator.api.rollout_spec import RolloutSpec
from dsv4_operator.api.scheduling_spec import SchedulingSpec
from dsv4_operator.api.schema import (
    Schema,
    integer,
    resources,
    string,
    string_list,
    string_map,
)

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")

DEFAULT_ENGINE_IMAGE = "dsv4/engine:0.1.0"
DEFAULT_GATEWAY_IMAGE = "dsv4/operator:0.1.0"  # the light control-plane image (no torch)
# How an engine pod stops (reconcile/shutdown.py sizes it): the preStop pause for endpoints to drop
# the pod, then the drain, then a margin to exit; a grace period below their sum drains nothing.
PRESTOP_S = 5
EXIT_MARGIN_S = 5
MIN_GRACE_S = PRESTOP_S + EXIT_MARGIN_S
# Engine flags the operator sets itself, on the command line or as engine.json keys (the engine
# takes those as flags too): engineArgs may not repeat them, nor a prefix of them (argparse takes
# a unique prefix for the whole flag). A unit test keeps this the set the operator renders.
OWNED_ENGINE_FLAGS = (
    "--architecture",
    "--config",
    "--context-parallel-size",
    "--data-parallel-size",
    "--device",
    "--dtype",
    "--enable-eplb",
    "--eplb-interval",
    "--eplb-redundant-experts",
    "--eplb-window",
    "--expert-parallel-size",
    "--host",
    "--kv-events-endpoint",
    "--kv-failure-policy",
    "--kv-pull-timeout",
    "--kv-sidecar",
    "--kv-sidecar-wait",
    "--max-model-len",
    "--model",
    "--num-speculative-tokens",
    "--otlp-traces-endpoint",
    "--port",
    "--prompt-deadline",
    "--quantization",
    "--rank-table",
    "--rendezvous-timeout",
    "--revision",
    "--role",
    "--served-model-name",
    "--shutdown-timeout",
    "--tensor-parallel-size",
    "--threads-per-rank",
)
# Models built into the engine image (dsv4_serving.presets; a unit test keeps them in step).
PRESETS = ("dsv3-small", "dsv4-tiny", "dsv4-tiny-long")


@crd_object(
    description="Checkpoint on a PersistentVolumeClaim (ReadOnlyMany or ReadWriteMany).",
)
@dataclass(frozen=True, kw_only=True)
class PvcSpec:
    claim_name: str = prop(
        string("PersistentVolumeClaim holding the checkpoint.", min_length=1, max_length=253),
        required=True,
    )
    sub_path: str = prop(string("Directory inside the volume.", default="", max_length=1024))


@crd_object(
    rules=[
        (
            "(has(self.path) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.preset) ? 1 : 0) == 1",
            "model: set exactly one of path, pvc or preset",
        ),
    ],
    description="What to serve and where the weights are.",
)
@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    path: str | None = prop(
        string(
            "Checkpoint directory on every node (mounted read-only from the host).",
            pattern="^/",
            max_length=1024,
        )
    )
    pvc: PvcSpec | None = section(PvcSpec)
    preset: str | None = prop(
        string(
            "A model built into the engine image (dsv4-tiny: for CPU smoke tests).",
            enum=list(PRESETS),
        )
    )
    architecture: str | None = prop(
        string(
            "The architecture the checkpoint's config.json must name; engines refuse to "
            "start on another model. Unset: whatever the checkpoint is.",
            enum=["DeepseekV4ForCausalLM", "DeepseekV3ForCausalLM"],
        )
    )
    dtype: str = prop(
        string(
            "Compute dtype.",
            default="bfloat16",
            enum=["auto", "bfloat16", "float16", "float32"],
        )
    )
    quantization: str = prop(
        string(
            "How the engine holds the weights: auto = as the checkpoint stores them (fp8 "
            "128x128 blocks, fp4 experts and W8A8 int8 stay quantized); none = dequantized "
            "to dtype at load; fp8, fp4 (fp8 linears + fp4 experts, DeepSeek-V4 as shipped) "
            "or w8a8 must match the checkpoint, or the engine refuses to start.",
            default="auto",
            enum=["auto", "none", "fp8", "fp4", "w8a8"],
        )
    )
    served_name: str = prop(
        string("Model name clients send in requests.", min_length=1, max_length=253),
        required=True,
    )
    max_model_len: int = prop(integer("Context length limit (tokens).", default=65536, minimum=16))

    @property
    def engine_model_arg(self) -> str:
        """What the engine's --model gets: a preset name or the mount path of the checkpoint."""
        if self.preset:
            return self.preset
        if self.path:
            return self.path
        return "/models/checkpoint"


@crd_object(defaulted=True)
@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    image: str = prop(
        string("Engine image.", default=DEFAULT_ENGINE_IMAGE, min_length=1, max_length=512)
    )
    image_pull_policy: str = prop(
        string("Pull policy.", default="IfNotPresent", enum=["Always", "IfNotPresent", "Never"])
    )
    image_pull_secrets: list[str] = prop(string_list("Secrets for pulling images.", max_items=16))


ENV_NAME = "^[-._a-zA-Z][-._a-zA-Z0-9]*$"


def _engine_args(role: str) -> Schema:
    """Each argument is checked on its own: one that sets (or abbreviates: argparse takes a
    unique prefix for the whole flag) a flag the operator sets is refused, by name."""
    owned = "[" + ", ".join(f"'{f}'" for f in OWNED_ENGINE_FLAGS) + "]"
    arg: Schema = {
        "type": "string",
        "maxLength": 1024,
        "x-kubernetes-validations": [
            {
                "rule": "!self.startsWith('--') || self.size() <= 2 || "
                f"!{owned}.exists(f, f.startsWith(self.split('=')[0]))",
                "messageExpression": f"'{role}.engineArgs: ' + self + ' sets what the operator "
                "sets from the deployment (use its fields: model, parallelism, mtpTokens, "
                "kvTransfer, terminationGracePeriodSeconds, ...)'",
            },
            {
                # the engine's one short flag: --context-parallel-size's alias
                "rule": "self != '-cp' && !self.startsWith('-cp=')",
                "messageExpression": f"'{role}.engineArgs: ' + self + ' sets what the operator "
                "sets from the deployment (use parallelism.cp)'",
            },
        ],
    }
    return {
        "type": "array",
        "description": "Extra engine command-line arguments, appended last; not the flags the "
        "operator sets (" + ", ".join(OWNED_ENGINE_FLAGS) + ").",
        "items": arg,
        "maxItems": 64,
    }


def _env(role: str) -> Schema:
    return {
        **string_map("Extra environment variables for the engine container."),
        "maxProperties": 256,
        "x-kubernetes-validations": [
            {
                "rule": f"self.all(k, k.size() <= 256 && k.matches('{ENV_NAME}'))",
                "message": f"{role}.env: variable names must be letters, digits, '_', "
                "'-' or '.', not starting with a digit (what every Kubernetes version "
                "accepts), at most 256 characters",
            }
        ],
    }


def _role_rules(role: str) -> list[tuple[str, str]]:
    return [
        (
            "isQuantity(self.shmSize)",
            f"{role}.shmSize must be a Kubernetes quantity such as 1Gi or 512Mi",
        ),
        (
            "!isQuantity(self.shmSize) || quantity(self.shmSize).compareTo(quantity('320Mi')) >= 0",
            f"{role}.shmSize must be at least 320Mi: the KV sidecar's staging region (at least "
            "64Mi) plus 256Mi for the engine's own shared memory",
        ),
        (
            f"self.npusPerNode == 0 || {RANKS_CEL} == self.nodesPerInstance * self.npusPerNode",
            f"{role}: parallelism.tp * parallelism.cp * parallelism.dp must equal "
            "nodesPerInstance * npusPerNode (one rank per NPU)",
        ),
        (
            # CPU: each pod runs tp*cp*dp/nodesPerInstance rank processes on its own CPUs
            f"self.npusPerNode > 0 || ({RANKS_CEL}) % self.nodesPerInstance == 0",
            f"{role}: on CPU (npusPerNode 0) parallelism.tp * parallelism.cp * parallelism.dp "
            "must be a multiple of nodesPerInstance (each pod runs tp * cp * dp / "
            "nodesPerInstance rank processes)",
        ),
        *cp_rules(role),
    ]


@crd_object(rules=_role_rules, defaulted=True, description=lambda role: f"The {role} role.")
@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """A role's section (``ctx``: the role)."""

    role: Role = place()
    instances: int = prop(
        lambda role: integer(
            f"Number of {role} instances (each one engine, possibly over several nodes).",
            default=1,
            minimum=0,
            maximum=512,
        )
    )
    nodes_per_instance: int = prop(
        integer("Nodes (pods) one instance spans.", default=1, minimum=1, maximum=64)
    )
    npus_per_node: int = prop(
        integer(
            "NPUs each pod requests; 0 runs on CPU: each pod runs tp * cp * dp / "
            "nodesPerInstance rank processes on its CPUs (development and tests).",
            default=8,
            minimum=0,
            maximum=16,
        )
    )
    parallelism: Parallelism = section(Parallelism)
    mtp_tokens: int = prop(
        integer("MTP speculative tokens per step (0 disables).", default=1, minimum=0, maximum=3)
    )
    engine_args: list[str] = prop(_engine_args)
    env: dict[str, str] = prop(_env)
    resources: dict[str, Any] = prop(
        resources("CPU/memory for the engine container; NPUs are added by the operator.")
    )
    shm_size: str = prop(
        string(
            "Size of the in-memory /dev/shm shared by the engine and the KV sidecar: "
            "the sidecar's staging region is this minus 256Mi for the engine.",
            default="16Gi",
            max_length=32,
        )
    )
    startup_timeout_s: int = prop(
        integer(
            "How long weight loading may take before the startup probe fails the pod.",
            default=1800,
            minimum=30,
        ),
        key="startupTimeoutSeconds",
    )
    termination_grace_s: int = prop(
        integer(
            f"The whole time an engine pod gets to stop: a {PRESTOP_S} s pause for "
            "endpoints to drop it, then the engine finishes in-flight requests and the KV "
            f"sidecar serves its exports (each --shutdown-timeout: this minus {MIN_GRACE_S}), "
            f"then {EXIT_MARGIN_S} s to exit.",
            default=120,
            minimum=MIN_GRACE_S,
            maximum=3600,
        ),
        key="terminationGracePeriodSeconds",
    )
    rollout: RolloutSpec = section(RolloutSpec)

    @property
    def on_npu(self) -> bool:
        return self.npus_per_node > 0

    @property
    def ranks_per_node(self) -> int:
        """Rank processes in each pod of an instance: one per NPU, or on CPU the tp x cp x dp
        ranks split evenly over the pods (the CRD refuses a split that is not even)."""
        return self.parallelism.ranks // self.nodes_per_instance


_ZERO = "quantity('0')"


@crd_object(
    defaulted=True,
    rules=[
        (
            f"isQuantity(self.hostBytes) && quantity(self.hostBytes).compareTo({_ZERO}) >= 0",
            "kvCache.hostBytes must be a Kubernetes quantity such as 4Gi (0: off)",
        ),
        (
            f"isQuantity(self.diskBytes) && (quantity(self.diskBytes).compareTo({_ZERO}) == 0 "
            "|| quantity(self.diskBytes).compareTo(quantity('1Mi')) >= 0)",
            "kvCache.diskBytes must be 0 (off) or a Kubernetes quantity of at least 1Mi, "
            "such as 20Gi",
        ),
        (
            f"!isQuantity(self.diskBytes) || quantity(self.diskBytes).compareTo({_ZERO}) == 0 "
            f"|| (isQuantity(self.hostBytes) && quantity(self.hostBytes).compareTo({_ZERO}) > 0)",
            "kvCache.diskBytes needs kvCache.hostBytes: the disk tier keeps what the host tier "
            "evicts",
        ),
    ],
)
@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    host_bytes: str = prop(
        string(
            "The KV sidecar's host tier: how much of its staging region keeps prefixes "
            "finished requests offered, for this engine and its peers to pull instead of "
            "recomputing (evicted least recently used; 0: off). At most the staging region "
            "(shmSize minus 256Mi).",
            default="0",
            max_length=32,
        )
    )
    disk_bytes: str = prop(
        string(
            "The KV sidecar's disk tier: entries the host tier evicts spill to files, at most "
            "this many bytes of them, and are read back (checked) when pulled (least recently "
            "spilled dropped first; 0: off). Needs hostBytes. The files live on an emptyDir "
            "volume of the pod (node disk, sized this plus hostBytes plus 64Mi), emptied when "
            "the pod goes.",
            default="0",
            max_length=32,
        )
    )


@crd_object(defaulted=True)
@dataclass(frozen=True, kw_only=True)
class KVTransferSpec:
    transport: str = prop(
        string(
            "How KV moves from prefill to decode: hccl (Ascend), rdma (Mooncake), tcp.",
            default="hccl",
            enum=["hccl", "tcp", "rdma"],
        )
    )
    port: int = prop(
        integer(
            f"KV sidecar port (its control API uses port+{SIDECAR_CONTROL_OFFSET} on "
            f"127.0.0.1, its metrics port+{SIDECAR_METRICS_OFFSET}).",
            default=KV_PORT,
            minimum=1024,
            maximum=65533,
        )
    )
    """The sidecar's peer port; its control API and metrics ports derive from it."""
    lease_seconds: int = prop(
        integer(
            "How long prefill keeps KV blocks for a decode that has not pulled them.",
            default=30,
            minimum=1,
            maximum=3600,
        )
    )
    failure_policy: str = prop(
        string(
            "What decode does when a KV pull fails or times out: recompute the prompt locally, "
            "or fail the request with a clear error.",
            default="recompute",
            enum=["recompute", "fail"],
        )
    )
    pull_timeout_s: int = prop(
        integer(
            "How long decode waits for a KV pull before the failure policy applies.",
            default=30,
            minimum=1,
            maximum=3600,
        ),
        key="pullTimeoutSeconds",
    )
    sidecar_image: str | None = prop(
        string("KV sidecar image; default the engine image.", max_length=512)
    )
    sidecar_resources: dict[str, Any] = prop(resources("CPU/memory for the KV sidecar container."))

    @property
    def control_port(self) -> int:
        return sidecar_control_port(self.port)

    @property
    def metrics_port(self) -> int:
        return sidecar_metrics_port(self.port)


@crd_object(description="Require this API key from clients (Authorization: Bearer).")
@dataclass(frozen=True, kw_only=True)
class SecretKeyRef:
    name: str = prop(string("Secret name.", min_length=1, max_length=253), required=True)
    key: str = prop(string("Key in the Secret.", default="api-key", min_length=1, max_length=253))


@crd_object(defaulted=True)
@dataclass(frozen=True, kw_only=True)
class GatewaySpec:
    replicas: int = prop(integer("Gateway replicas.", default=1, minimum=0, maximum=64))
    image: str = prop(
        string("Gateway image (no torch needed).", default=DEFAULT_GATEWAY_IMAGE, max_length=512)
    )
    routing_policy: str = prop(
        string(
            "How the gateway picks instances.",
            default="dplb",
            enum=["dplb", "least_load", "round_robin"],
        )
    )
    service_type: str = prop(
        string(
            "Type of the gateway Service.",
            default="ClusterIP",
            enum=["ClusterIP", "NodePort", "LoadBalancer"],
        )
    )
    port: int = prop(integer("Gateway Service port.", default=8000, minimum=1, maximum=65535))
    api_key_secret: SecretKeyRef | None = section(SecretKeyRef)
    resources: dict[str, Any] = prop(resources("CPU/memory for the gateway container."))


def _eplb_needs_ep_rule() -> tuple[str, str]:
    ep = (
        f"(has(self.{r}.parallelism.ep) ? self.{r}.parallelism.ep : "
        f"self.{r}.parallelism.tp * self.{r}.parallelism.dp) > 1"
        for r in ROLES
    )
    return (
        "!self.features.eplb.enabled || (" + " && ".join(ep) + ")",
        "features.eplb needs expert parallelism > 1 on both roles (parallelism.ep, "
        "by default tp * dp): it balances experts over an instance's EP ranks",
    )


@crd_object(
    rules=[
        (
            "self.prefill.parallelism.tp >= self.decode.parallelism.tp && "
            "self.prefill.parallelism.tp % self.decode.parallelism.tp == 0",
            "prefill.parallelism.tp must be >= decode.parallelism.tp and a multiple of it",
        ),
        (
            "self.kvTransfer.transport != 'hccl' || "
            "(self.prefill.npusPerNode > 0 && self.decode.npusPerNode > 0)",
            "kvTransfer.transport hccl needs NPUs on both roles (npusPerNode > 0); use tcp on CPU",
        ),
        _eplb_needs_ep_rule(),
        (
            "!self.autoscaling.enabled || self.scheduling.workload != 'LeaderWorkerSet'",
            not_yet(
                "autoscaling with scheduling.workload LeaderWorkerSet",
                "the autoscaler counts and drains StatefulSet instances only",
                "use workload StatefulSet or size instances by hand",
            ),
        ),
    ]
)
@dataclass(frozen=True, kw_only=True)
class DeploymentSpec:
    """The deployment: its metadata, then ``spec``'s sections."""

    name: str
    namespace: str
    uid: str
    generation: int
    labels: dict[str, str]
    model: ModelSpec = section(ModelSpec, required=True)
    engine: EngineSpec = section(EngineSpec)
    prefill: RoleSpec = section(RoleSpec, ctx="prefill")
    decode: RoleSpec = section(RoleSpec, ctx="decode")
    kv: KVTransferSpec = section(KVTransferSpec, key="kvTransfer")
    kv_cache: KVCacheSpec = section(KVCacheSpec, key="kvCache")
    gateway: GatewaySpec = section(GatewaySpec)
    autoscaling: AutoscalingSpec = section(AutoscalingSpec)
    scheduling: SchedulingSpec = section(SchedulingSpec)
    features: FeaturesSpec = section(FeaturesSpec)
    observability: ObservabilitySpec = section(ObservabilitySpec)

    def role(self, role: Role) -> RoleSpec:
        return self.prefill if role == "prefill" else self.decode

    @property
    def sidecar_image(self) -> str:
        return self.kv.sidecar_image or self.engine.image


def spec_schema() -> Schema:
    """The CRD's ``spec``."""
    return object_schema(DeploymentSpec)


def apply_defaults(schema: Schema, value: Any) -> Any:
    """Structural defaulting as the API server does it: fill absent fields that have defaults."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    out = copy.deepcopy(value)
    for name, prop_schema in schema.get("properties", {}).items():
        if name not in out and "default" in prop_schema:
            out[name] = copy.deepcopy(prop_schema["default"])
        if name in out:
            out[name] = apply_defaults(prop_schema, out[name])
    return out


def parse(body: dict[str, Any]) -> DeploymentSpec:
    """A DeploymentSpec from a DeepSeekV4Deployment object (dict as read from the API)."""
    meta = body["metadata"]
    return from_crd(
        DeploymentSpec,
        apply_defaults(spec_schema(), body.get("spec") or {}),
        name=meta["name"],
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation", 0)),
        labels=dict(meta.get("labels") or {}),
    )
