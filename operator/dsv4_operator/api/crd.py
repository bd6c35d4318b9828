"""The DeepSeekV4Deployment CRD, built in code: the one source of truth for manifests/ and the chart.

Structural schema with defaults (so the operator sees a complete spec), CEL rules for checks that
span fields (messages written for the person who made the mistake), a status subresource and
printer columns. ``scripts/gen-manifests`` writes it out; a test fails if the copies drift.
"""

from __future__ import annotations

from typing import Any

from dsv4_common.ports import KV_PORT, SIDECAR_CONTROL_OFFSET, SIDECAR_METRICS_OFFSET
from dsv4_operator.api import (
    DEFAULT_NPU_RESOURCE,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAME,
    SINGULAR,
    VERSION,
)
from dsv4_operator.api.autoscaling_schema import autoscaling_schema
from dsv4_operator.api.observability_schema import observability_schema
from dsv4_operator.api.schema import (
    Schema,
    boolean,
    integer,
    obj,
    opaque,
    resources,
    string,
    string_list,
    string_map,
)
from dsv4_operator.api.status_schema import printer_columns, status_schema

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
    "--data-parallel-size",
    "--device",
    "--dtype",
    "--enable-eplb",
    "--eplb-interval",
    "--eplb-redundant-experts",
    "--eplb-window",
    "--expert-parallel-size",
    "--host",
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
    "--role",
    "--served-model-name",
    "--shutdown-timeout",
    "--tensor-parallel-size",
    "--threads-per-rank",
)
# Models built into the engine image (dsv4_serving.presets; a unit test keeps them in step).
PRESETS = ("dsv3-small", "dsv4-tiny")
MAX_NAME = 40  # children append "-prefill-NN-ranktable"; pod names must stay DNS labels (63)


def _not_yet(field: str, why: str, fix: str) -> str:
    """The message of a rule that keeps a field at its default until something acts on it."""
    return f"{field} is not supported yet ({why}); {fix}"


_NAME_RULE = (
    f"self.metadata.name.size() <= {MAX_NAME} && "
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
    f"metadata.name must be a DNS label of at most {MAX_NAME} characters starting with a letter "
    "(it prefixes the names of the Services and pods the operator creates)",
)


def _model() -> Schema:
    return obj(
        {
            "path": string(
                "Checkpoint directory on every node (mounted read-only from the host).",
                pattern="^/",
                max_length=1024,
            ),
            "pvc": obj(
                {
                    "claimName": string(
                        "PersistentVolumeClaim holding the checkpoint.",
                        min_length=1,
                        max_length=253,
                    ),
                    "subPath": string("Directory inside the volume.", default="", max_length=1024),
                },
                required=["claimName"],
                description="Checkpoint on a PersistentVolumeClaim (ReadOnlyMany or ReadWriteMany).",
            ),
            "preset": string(
                "A model built into the engine image (dsv4-tiny: for CPU smoke tests).",
                enum=list(PRESETS),
            ),
            "architecture": string(
                "The architecture the checkpoint's config.json must name; engines refuse to "
                "start on another model. Unset: whatever the checkpoint is.",
                enum=["DeepseekV4ForCausalLM", "DeepseekV3ForCausalLM"],
            ),
            "dtype": string(
                "Compute dtype.",
                default="bfloat16",
                enum=["auto", "bfloat16", "float16", "float32"],
            ),
            "quantization": string(
                "How the engine holds the weights: auto = as the checkpoint stores them (fp8 "
                "128x128 blocks, fp4 experts and W8A8 int8 stay quantized); none = dequantized "
                "to dtype at load; fp8, fp4 (fp8 linears + fp4 experts, DeepSeek-V4 as shipped) "
                "or w8a8 must match the checkpoint, or the engine refuses to start.",
                default="auto",
                enum=["auto", "none", "fp8", "fp4", "w8a8"],
            ),
            "servedName": string(
                "Model name clients send in requests.", min_length=1, max_length=253
            ),
            "maxModelLen": integer("Context length limit (tokens).", default=65536, minimum=16),
        },
        required=["servedName"],
        rules=[
            (
                "(has(self.path) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.preset) ? 1 : 0) == 1",
                "model: set exactly one of path, pvc or preset",
            ),
        ],
        description="What to serve and where the weights are.",
    )


def _parallelism() -> Schema:
    return obj(
        {
            "tp": integer(
                "Tensor-parallel size (attention heads split across ranks).",
                default=8,
                minimum=1,
                maximum=256,
            ),
            "dp": integer(
                "Data-parallel ranks per instance (DPLB balances across them).",
                default=1,
                minimum=1,
                maximum=256,
            ),
            "ep": integer(
                "Expert-parallel size: 1 or tp*dp (the default).", minimum=1, maximum=1024
            ),
        },
        rules=[
            (
                "!has(self.ep) || self.ep == 1 || self.ep == self.tp * self.dp",
                "parallelism.ep must be 1 (every rank holds every expert) or tp * dp "
                "(experts spread over every rank; the default)",
            )
        ],
        default={},
    )


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
            }
        ],
    }
    return {
        "type": "array",
        "description": "Extra engine command-line arguments, appended last; not the flags the "
        "operator sets (" + ", ".join(OWNED_ENGINE_FLAGS) + ").",
        "items": arg,
        "maxItems": 64,
    }


def _role(role: str) -> Schema:
    return obj(
        {
            "instances": integer(
                f"Number of {role} instances (each one engine, possibly over several nodes).",
                default=1,
                minimum=0,
                maximum=512,
            ),
            "nodesPerInstance": integer(
                "Nodes (pods) one instance spans.", default=1, minimum=1, maximum=64
            ),
            "npusPerNode": integer(
                "NPUs each pod requests; 0 runs on CPU: each pod runs tp * dp / "
                "nodesPerInstance rank processes on its CPUs (development and tests).",
                default=8,
                minimum=0,
                maximum=16,
            ),
            "parallelism": _parallelism(),
            "mtpTokens": integer(
                "MTP speculative tokens per step (0 disables).", default=1, minimum=0, maximum=3
            ),
            "engineArgs": _engine_args(role),
            "env": {
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
            },
            "resources": resources(
                "CPU/memory for the engine container; NPUs are added by the operator."
            ),
            "shmSize": {
                **string(
                    "Size of the in-memory /dev/shm shared by the engine and the KV sidecar: "
                    "the sidecar's staging region is this minus 256Mi for the engine.",
                    default="16Gi",
                    max_length=32,
                )
            },
            "startupTimeoutSeconds": integer(
                "How long weight loading may take before the startup probe fails the pod.",
                default=1800,
                minimum=30,
            ),
            "terminationGracePeriodSeconds": integer(
                f"The whole time an engine pod gets to stop: a {PRESTOP_S} s pause for "
                "endpoints to drop it, then the engine finishes in-flight requests and the KV "
                f"sidecar serves its exports (each --shutdown-timeout: this minus {MIN_GRACE_S}), "
                f"then {EXIT_MARGIN_S} s to exit.",
                default=120,
                minimum=MIN_GRACE_S,
                maximum=3600,
            ),
        },
        rules=[
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
                "self.npusPerNode == 0 || "
                "self.parallelism.tp * self.parallelism.dp == self.nodesPerInstance * self.npusPerNode",
                f"{role}: parallelism.tp * parallelism.dp must equal nodesPerInstance * npusPerNode "
                "(one rank per NPU)",
            ),
            (
                # CPU: each pod runs tp*dp/nodesPerInstance rank processes on its own CPUs
                "self.npusPerNode > 0 || "
                "(self.parallelism.tp * self.parallelism.dp) % self.nodesPerInstance == 0",
                f"{role}: on CPU (npusPerNode 0) parallelism.tp * parallelism.dp must be a multiple "
                "of nodesPerInstance (each pod runs tp * dp / nodesPerInstance rank processes)",
            ),
        ],
        default={},
        description=f"The {role} role.",
    )


def _kv_transfer() -> Schema:
    return obj(
        {
            "transport": string(
                "How KV moves from prefill to decode: hccl (Ascend), rdma (Mooncake), tcp.",
                default="hccl",
                enum=["hccl", "tcp", "rdma"],
            ),
            "port": integer(
                f"KV sidecar port (its control API uses port+{SIDECAR_CONTROL_OFFSET} on "
                f"127.0.0.1, its metrics port+{SIDECAR_METRICS_OFFSET}).",
                default=KV_PORT,
                minimum=1024,
                maximum=65533,
            ),
            "leaseSeconds": integer(
                "How long prefill keeps KV blocks for a decode that has not pulled them.",
                default=30,
                minimum=1,
                maximum=3600,
            ),
            "failurePolicy": string(
                "What decode does when a KV pull fails or times out: recompute the prompt locally, "
                "or fail the request with a clear error.",
                default="recompute",
                enum=["recompute", "fail"],
            ),
            "pullTimeoutSeconds": integer(
                "How long decode waits for a KV pull before the failure policy applies.",
                default=30,
                minimum=1,
                maximum=3600,
            ),
            "sidecarImage": string("KV sidecar image; default the engine image.", max_length=512),
            "sidecarResources": resources("CPU/memory for the KV sidecar container."),
        },
        default={},
    )


def _gateway() -> Schema:
    return obj(
        {
            "replicas": integer("Gateway replicas.", default=1, minimum=0, maximum=64),
            "image": string(
                "Gateway image (no torch needed).", default=DEFAULT_GATEWAY_IMAGE, max_length=512
            ),
            "routingPolicy": string(
                "How the gateway picks instances.",
                default="dplb",
                enum=["dplb", "least_load", "round_robin"],
            ),
            "serviceType": string(
                "Type of the gateway Service.",
                default="ClusterIP",
                enum=["ClusterIP", "NodePort", "LoadBalancer"],
            ),
            "port": integer("Gateway Service port.", default=8000, minimum=1, maximum=65535),
            "apiKeySecret": obj(
                {
                    "name": string("Secret name.", min_length=1, max_length=253),
                    "key": string(
                        "Key in the Secret.", default="api-key", min_length=1, max_length=253
                    ),
                },
                required=["name"],
                description="Require this API key from clients (Authorization: Bearer).",
            ),
            "resources": resources("CPU/memory for the gateway container."),
        },
        default={},
    )


def _scheduling() -> Schema:
    return obj(
        {
            "npuResourceName": string(
                "Extended resource of the NPU device plugin.",
                default=DEFAULT_NPU_RESOURCE,
                pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
                max_length=253,
            ),
            "workload": string(
                "Workload kind for multi-node instances.",
                default="StatefulSet",
                enum=["StatefulSet", "LeaderWorkerSet"],
            ),
            "nodeSelector": string_map("Node labels engine pods require."),
            "tolerations": opaque("Tolerations for engine pods.", array=True),
            "affinity": opaque("Affinity for engine pods."),
            "topologySpreadConstraints": opaque("Topology spread for engine pods.", array=True),
            "priorityClassName": string("Priority class of engine pods.", max_length=253),
        },
        default={},
    )


def _features() -> Schema:
    return obj(
        {
            "eplb": obj(
                {
                    "enabled": boolean(
                        "Expert-parallel load balancing: engines count each MoE layer's expert "
                        "load and every intervalSteps re-place experts over their EP ranks, "
                        "live (needs expert parallelism > 1 on both roles).",
                        default=False,
                    ),
                    "redundantExperts": integer(
                        "Extra physical expert slots per MoE layer (in total over an "
                        "instance's EP ranks) for replicas of hot experts; routed experts + "
                        "redundant must split evenly over the EP ranks.",
                        default=0,
                        minimum=0,
                        maximum=64,
                    ),
                    "intervalSteps": integer(
                        "Forward steps between expert re-placements.", default=600, minimum=1
                    ),
                    "windowSteps": integer(
                        "The last this many forward steps' expert load decide a re-placement.",
                        default=600,
                        minimum=1,
                    ),
                },
                rules=[
                    (
                        "self.enabled || self.redundantExperts == 0",
                        "features.eplb.redundantExperts needs features.eplb.enabled",
                    )
                ],
                default={},
                description="Expert-parallel load balancing (EPLB, docs/eplb.md).",
            ),
            "mlapo": boolean(
                "Fused MLA preprocessing kernels (on Ascend). Not supported yet: must be true "
                "(the default).",
                default=True,
            ),
            "c8": string(
                "8-bit KV block mode for sparse attention. Not supported yet: must be auto.",
                default="auto",
                enum=["auto", "on", "off"],
            ),
            "hccnConf": obj(
                {
                    "enabled": boolean(
                        "Mount the host's hccn.conf (NPU network config).", default=True
                    ),
                    "hostPath": string(
                        "Where hccn.conf is on the node (a file of that name: anyone who may "
                        "create the CR chooses it, so it cannot name any other file).",
                        default="/etc/hccn.conf",
                        max_length=256,
                    ),
                },
                rules=[
                    (
                        "self.hostPath.matches('^(/[-_.a-zA-Z0-9]+)*/hccn[.]conf$') && "
                        "!self.hostPath.contains('/../')",
                        "features.hccnConf.hostPath must be an absolute path to a file named "
                        "hccn.conf (no '..')",
                    )
                ],
                default={},
            ),
            "privileged": boolean("Run engine containers privileged (opt-in).", default=False),
        },
        rules=[
            (
                "self.mlapo",
                _not_yet(
                    "features.mlapo", "the engine has no switch for it", "remove it or set true"
                ),
            ),
            (
                "self.c8 == 'auto'",
                _not_yet("features.c8", "the engine has no switch for it", "remove it or set auto"),
            ),
        ],
        default={},
    )


def spec_schema() -> Schema:
    return obj(
        {
            "model": _model(),
            "engine": obj(
                {
                    "image": string(
                        "Engine image.", default=DEFAULT_ENGINE_IMAGE, min_length=1, max_length=512
                    ),
                    "imagePullPolicy": string(
                        "Pull policy.",
                        default="IfNotPresent",
                        enum=["Always", "IfNotPresent", "Never"],
                    ),
                    "imagePullSecrets": string_list("Secrets for pulling images.", max_items=16),
                },
                default={},
            ),
            "prefill": _role("prefill"),
            "decode": _role("decode"),
            "kvTransfer": _kv_transfer(),
            "gateway": _gateway(),
            "autoscaling": autoscaling_schema(),
            "scheduling": _scheduling(),
            "features": _features(),
            "observability": observability_schema(),
        },
        required=["model"],
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
            (
                "!self.features.eplb.enabled || ("
                + " && ".join(
                    f"(has(self.{r}.parallelism.ep) ? self.{r}.parallelism.ep : "
                    f"self.{r}.parallelism.tp * self.{r}.parallelism.dp) > 1"
                    for r in ("prefill", "decode")
                )
                + ")",
                "features.eplb needs expert parallelism > 1 on both roles (parallelism.ep, "
                "by default tp * dp): it balances experts over an instance's EP ranks",
            ),
            (
                "!self.autoscaling.enabled || self.scheduling.workload != 'LeaderWorkerSet'",
                _not_yet(
                    "autoscaling with scheduling.workload LeaderWorkerSet",
                    "the autoscaler counts and drains StatefulSet instances only",
                    "use workload StatefulSet or size instances by hand",
                ),
            ),
        ],
    )


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object, as applied to a cluster."""
    root = obj(
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        required=["spec"],
        rules=[_NAME_RULE],
        description="A DeepSeek V4 (or V3) deployment with disaggregated prefill and decode on Ascend NPUs.",
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "dsv4", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": [SHORT_NAME],
                "categories": ["all", "dsv4"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                }
            ],
        },
    }
