"""The engine pod: engine + kv-sidecar containers sharing an in-memory /dev/shm.

Command-line contract with the engine and sidecar (``dsv4 engine``, ``dsv4 kv-sidecar``) lives
here and in docs/operator.md: the per-role engine flags are on the command line, the
deployment-wide engine settings in engine.json (``engine_config.py``).
"""

from __future__ import annotations

from typing import Any

from dsv4_common.ports import ENGINE_PORT
from dsv4_operator.api.spec import DeploymentSpec, RoleSpec
from dsv4_operator.reconcile import names
from dsv4_operator.reconcile.cpu_ranks import rank_threads
from dsv4_operator.reconcile.engine_config import ENGINE_CONFIG_KEY
from dsv4_operator.reconcile.identity import RANKTABLE_DIR, Identity
from dsv4_operator.reconcile.kv_disk import disk_tier_flags, disk_tier_mounts, disk_tier_volume
from dsv4_operator.reconcile.shm import host_tier_bytes, staging_bytes
from dsv4_operator.reconcile.shutdown import role_shutdown
from dsv4_operator.reconcile.tracing import tracing_args

CONFIG_DIR = "/etc/dsv4"
KV_AUTH_DIR = "/etc/dsv4/kv-auth"
MODEL_DIR = "/models/checkpoint"
PROBE_PERIOD_S = 10


def _downward(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _security(spec: DeploymentSpec) -> dict[str, Any]:
    if spec.features.privileged:
        return {"privileged": True}
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
    }


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": names.METRICS_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def engine_command(
    role: RoleSpec, prompt_deadline_s: float | None = None, revision: str = ""
) -> list[str]:
    """The per-role flags; the deployment-wide settings are in engine.json (``--config``).
    ``prompt_deadline_s``: the SLO-aware prompt order (``autoscaling.prefill``), prefill only;
    ``revision``: the deployment revision the engine runs as (reconcile/revision.py)."""
    par = role.parallelism
    cmd = [
        "dsv4",
        "engine",
        "--config",
        f"{CONFIG_DIR}/{ENGINE_CONFIG_KEY}",
        "--role",
        role.role,
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--tensor-parallel-size",
        str(par.tp),
        "--data-parallel-size",
        str(par.dp),
        "--expert-parallel-size",
        str(par.ep),
        "--num-speculative-tokens",
        str(role.mtp_tokens),
        "--device",
        "npu" if role.on_npu else "cpu",
        # per role (engine.json is shared by both): the drain fits the role's grace period
        "--shutdown-timeout",
        str(role_shutdown(role).drain_s),
    ]
    if par.cp > 1:
        cmd += ["--context-parallel-size", str(par.cp)]
    if role.on_npu:
        cmd += ["--rank-table", "$(RANK_TABLE_FILE)"]
    else:
        # the pod's CPUs split over its rank processes (reconcile/cpu_ranks.py)
        cmd += ["--threads-per-rank", str(rank_threads(role))]
    if role.nodes_per_instance > 1:
        # the pods may start minutes apart (an image pulled on one node only): the ranks wait
        # for each other as long as the startup probe waits for the pod
        cmd += ["--rendezvous-timeout", str(role.startup_timeout_s)]
    if prompt_deadline_s is not None and role.role == "prefill":
        # the decode role computes no prompts (their KV is pulled), so it keeps FCFS
        cmd += ["--prompt-deadline", f"{prompt_deadline_s:g}"]
    if revision:
        cmd += ["--revision", revision]
    return cmd + role.engine_args


def sidecar_command(spec: DeploymentSpec, role: RoleSpec) -> list[str]:
    kv = spec.kv
    return [
        "dsv4",
        "kv-sidecar",
        "--transport",
        kv.transport,
        "--port",
        str(kv.port),
        # the control API stays on 127.0.0.1: the engine beside it is its only client
        "--control-port",
        str(kv.control_port),
        "--engine-url",
        f"http://127.0.0.1:{ENGINE_PORT}",
        "--lease-seconds",
        str(kv.lease_seconds),
        "--auth-token-file",
        f"{KV_AUTH_DIR}/token",
        # Prometheus and probes from outside the pod reach only this port
        "--metrics-port",
        str(kv.metrics_port),
        # the staging region shares the pod's /dev/shm with the engine (reconcile/shm.py)
        "--staging-bytes",
        str(staging_bytes(role.role, role.shm_size)),
        "--kv-host-bytes",
        str(host_tier_bytes(role.role, spec.kv_cache.host_bytes, role.shm_size)),
        *disk_tier_flags(spec),
        "--shutdown-timeout",
        str(role_shutdown(role).drain_s),
        *tracing_args(spec),
    ]


def _engine_resources(spec: DeploymentSpec, role: RoleSpec) -> dict[str, Any]:
    res = {k: dict(v) for k, v in role.resources.items()}
    if role.on_npu:
        n = str(role.npus_per_node)
        res.setdefault("requests", {})[spec.scheduling.npu_resource] = n
        res.setdefault("limits", {})[spec.scheduling.npu_resource] = n
    return res


def _volumes(
    spec: DeploymentSpec, role: RoleSpec, identity: Identity
) -> tuple[list[Any], list[Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": role.shm_size}},
        {"name": "config", "configMap": {"name": names.engine_config_name(spec)}},
        {
            "name": "kv-auth",
            "secret": {"secretName": names.kv_secret_name(spec), "defaultMode": 0o440},
        },
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "shm", "mountPath": "/dev/shm"},
        {
            "name": "config",
            "mountPath": f"{CONFIG_DIR}/{ENGINE_CONFIG_KEY}",
            "subPath": ENGINE_CONFIG_KEY,
            "readOnly": True,
        },
    ]
    m = spec.model
    if m.path:
        volumes.append({"name": "model", "hostPath": {"path": m.path, "type": "Directory"}})
        mounts.append({"name": "model", "mountPath": m.path, "readOnly": True})
    elif m.pvc:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": m.pvc.claim_name, "readOnly": True},
            }
        )
        mounts.append(
            {"name": "model", "mountPath": MODEL_DIR, "subPath": m.pvc.sub_path, "readOnly": True}
        )
    if role.on_npu:
        table = identity.ranktable_configmap(spec, role)
        volumes.append({"name": "ranktable", "configMap": {"name": table}})
        mounts.append({"name": "ranktable", "mountPath": RANKTABLE_DIR, "readOnly": True})
        volumes.append(
            {
                "name": "ascend-driver",
                "hostPath": {"path": "/usr/local/Ascend/driver", "type": "Directory"},
            }
        )
        mounts.append(
            {"name": "ascend-driver", "mountPath": "/usr/local/Ascend/driver", "readOnly": True}
        )
        hccn = spec.features.hccn_conf
        if hccn.enabled:
            volumes.append(
                {"name": "hccn-conf", "hostPath": {"path": hccn.host_path, "type": "File"}}
            )
            mounts.append({"name": "hccn-conf", "mountPath": "/etc/hccn.conf", "readOnly": True})
    host = host_tier_bytes(role.role, spec.kv_cache.host_bytes, role.shm_size)
    volumes += disk_tier_volume(spec, host)  # last: the other volumes keep their indices
    return volumes, mounts


def pod_template(
    spec: DeploymentSpec, role: RoleSpec, identity: Identity, revision: str = ""
) -> dict[str, Any]:
    """Pod template of ``role``'s engine pods; ``identity`` says how a pod learns its instance
    and node rank (the workload kind decides); ``revision``: labelled and passed to the engine
    (empty: neither, which is how the revision itself is computed)."""
    volumes, mounts = _volumes(spec, role, identity)
    shutdown = role_shutdown(role)
    env = [
        _downward("POD_NAME", "metadata.name"),
        _downward("POD_NAMESPACE", "metadata.namespace"),
        _downward("POD_IP", "status.podIP"),
        _downward("NODE_NAME", "spec.nodeName"),
        *identity.env(spec, role),
        {"name": "HCCL_IF_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HCCL_CONNECT_TIMEOUT", "value": "1200"},
        *({"name": k, "value": v} for k, v in sorted(role.env.items())),
    ]
    engine = {
        "name": "engine",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": engine_command(role, spec.autoscaling.prefill.prompt_deadline_s, revision),
        "env": env,
        "ports": [{"name": names.METRICS_PORT_NAME, "containerPort": ENGINE_PORT}],
        "resources": _engine_resources(spec, role),
        "volumeMounts": mounts,
        "startupProbe": _probe(
            "/health", PROBE_PERIOD_S, max(1, role.startup_timeout_s // PROBE_PERIOD_S)
        ),
        # ready: loaded and not draining; alive: the process and its engine core (also draining)
        "readinessProbe": _probe("/ready", 5, 3),
        "livenessProbe": _probe("/health", PROBE_PERIOD_S, 6),
        "lifecycle": shutdown.lifecycle(),
        "securityContext": _security(spec),
    }
    sidecar = {
        "name": "kv-sidecar",
        "image": spec.sidecar_image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": sidecar_command(spec, role),
        "env": [_downward("POD_IP", "status.podIP")],
        "ports": [
            {"name": "kv", "containerPort": spec.kv.port},
            {"name": "kv-metrics", "containerPort": spec.kv.metrics_port},
        ],
        "resources": spec.kv.sidecar_resources or {"requests": {"cpu": "1", "memory": "2Gi"}},
        "volumeMounts": [
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "kv-auth", "mountPath": KV_AUTH_DIR, "readOnly": True},
            *disk_tier_mounts(spec),
        ],
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "kv-metrics"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "lifecycle": shutdown.lifecycle(),
        "securityContext": _security(spec),
    }
    pod_spec: dict[str, Any] = {
        "containers": [engine, sidecar],
        "volumes": volumes,
        "terminationGracePeriodSeconds": shutdown.grace_s,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {} if spec.features.privileged else {"fsGroup": 1000},
    }
    sched = spec.scheduling
    optional: dict[str, Any] = {
        "nodeSelector": sched.node_selector,
        "tolerations": sched.tolerations,
        "affinity": sched.affinity,
        "topologySpreadConstraints": sched.topology_spread_constraints,
        "priorityClassName": sched.priority_class_name,
        "imagePullSecrets": [{"name": s} for s in spec.engine.image_pull_secrets],
    }
    pod_spec.update({k: v for k, v in optional.items() if v})
    labels = identity.labels(spec, role)
    if revision:
        labels = {**labels, names.REVISION_LABEL: revision}
    return {"metadata": {"labels": labels}, "spec": pod_spec}
