"""The engine pod: engine + kv-sidecar containers sharing an in-memory /dev/shm.

Command-line contract with the engine and sidecar (``dsv4 engine``, ``dsv4 kv-sidecar``) lives
here and in docs/operator.md; the deployment-wide settings go in the engine ConfigMap.
"""

from __future__ import annotations

from typing import Any

from dsv4_operator.api.spec import DeploymentSpec, RoleSpec
from dsv4_operator.reconcile import names

CONFIG_DIR = "/etc/dsv4"
RANKTABLE_DIR = "/etc/dsv4/ranktable"
KV_AUTH_DIR = "/etc/dsv4/kv-auth"
MODEL_DIR = "/models/checkpoint"
PROBE_PERIOD_S = 10


def _downward(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _security(spec: DeploymentSpec) -> dict[str, Any]:
    if spec.features["privileged"]:
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


def engine_command(spec: DeploymentSpec, role: RoleSpec) -> list[str]:
    par = role.parallelism
    cmd = [
        "dsv4",
        "engine",
        "--config",
        f"{CONFIG_DIR}/engine.json",
        "--role",
        role.role,
        "--model",
        spec.model.engine_model_arg,
        "--served-model-name",
        spec.model.served_name,
        "--host",
        "0.0.0.0",
        "--port",
        str(names.ENGINE_PORT),
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
    ]
    cmd += [
        # the sidecar's control API listens on 127.0.0.1 at the KV port + 1 (same pod)
        "--kv-sidecar",
        f"http://127.0.0.1:{int(spec.kv['port']) + 1}",
        "--kv-failure-policy",
        str(spec.kv["failurePolicy"]),
        "--kv-pull-timeout",
        str(spec.kv["pullTimeoutSeconds"]),
    ]
    if role.on_npu:
        cmd += ["--rank-table", "$(RANK_TABLE_FILE)"]
    return cmd + role.engine_args


def sidecar_command(spec: DeploymentSpec) -> list[str]:
    return [
        "dsv4",
        "kv-sidecar",
        "--transport",
        str(spec.kv["transport"]),
        "--port",
        str(spec.kv["port"]),
        "--engine-url",
        f"http://127.0.0.1:{names.ENGINE_PORT}",
        "--lease-seconds",
        str(spec.kv["leaseSeconds"]),
        "--auth-token-file",
        f"{KV_AUTH_DIR}/token",
        # the control API stays on 127.0.0.1 (the engine's); Prometheus scrapes this port only
        "--metrics-port",
        str(sidecar_metrics_port(spec)),
    ]


def sidecar_metrics_port(spec: DeploymentSpec) -> int:
    """KV port + 2 (the sidecar's control API takes port + 1)."""
    return int(spec.kv["port"]) + 2


def _engine_resources(spec: DeploymentSpec, role: RoleSpec) -> dict[str, Any]:
    res = {k: dict(v) for k, v in role.resources.items()}
    if role.on_npu:
        n = str(role.npus_per_node)
        res.setdefault("requests", {})[spec.npu_resource] = n
        res.setdefault("limits", {})[spec.npu_resource] = n
    return res


def _volumes(
    spec: DeploymentSpec, role: RoleSpec, instance: int, lws: bool
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
            "mountPath": CONFIG_DIR + "/engine.json",
            "subPath": "engine.json",
            "readOnly": True,
        },
    ]
    m = spec.model
    if m.path:
        volumes.append({"name": "model", "hostPath": {"path": m.path, "type": "Directory"}})
        mounts.append({"name": "model", "mountPath": m.path, "readOnly": True})
    elif m.pvc_claim:
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": m.pvc_claim, "readOnly": True}}
        )
        mounts.append(
            {"name": "model", "mountPath": MODEL_DIR, "subPath": m.pvc_sub_path, "readOnly": True}
        )
    if role.on_npu:
        # StatefulSet mode: one ConfigMap per instance; LeaderWorkerSet mode: one per role with a
        # key per instance (the pod template is shared by all groups).
        table = (
            names.ranktable_name(spec, role.role, instance)
            if not lws
            else names.ranktables_name(spec, role.role)
        )
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
        hccn = spec.features["hccnConf"]
        if hccn["enabled"]:
            volumes.append(
                {"name": "hccn-conf", "hostPath": {"path": hccn["hostPath"], "type": "File"}}
            )
            mounts.append({"name": "hccn-conf", "mountPath": "/etc/hccn.conf", "readOnly": True})
    return volumes, mounts


def pod_template(
    spec: DeploymentSpec, role: RoleSpec, instance: int, lws: bool = False
) -> dict[str, Any]:
    """Pod template for one instance of ``role``; node rank = the StatefulSet pod index."""
    labels = names.instance_labels(spec, role.role, instance)
    volumes, mounts = _volumes(spec, role, instance, lws)
    table = "hccl-$(DSV4_INSTANCE).json" if lws else "hccl.json"
    env = [
        _downward("POD_NAME", "metadata.name"),
        _downward("POD_NAMESPACE", "metadata.namespace"),
        _downward("POD_IP", "status.podIP"),
        _downward("NODE_NAME", "spec.nodeName"),
        _downward("DSV4_NODE_RANK", "metadata.labels['apps.kubernetes.io/pod-index']"),
        {"name": "DSV4_INSTANCE", "value": str(instance)},
        {"name": "DSV4_NODES_PER_INSTANCE", "value": str(role.nodes_per_instance)},
        # The leader (pod index 0) hosts torch.distributed's rendezvous for multi-node instances.
        {
            "name": "DSV4_MASTER_ADDR",
            "value": f"{names.instance_name(spec, role.role, instance)}-0.{names.role_service(spec, role.role)}",
        },
        {"name": "HCCL_IF_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "RANK_TABLE_FILE", "value": f"{RANKTABLE_DIR}/{table}"},
        {"name": "HCCL_CONNECT_TIMEOUT", "value": "1200"},
        *({"name": k, "value": v} for k, v in sorted(role.env.items())),
    ]
    engine = {
        "name": "engine",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": engine_command(spec, role),
        "env": env,
        "ports": [{"name": names.METRICS_PORT_NAME, "containerPort": names.ENGINE_PORT}],
        "resources": _engine_resources(spec, role),
        "volumeMounts": mounts,
        "startupProbe": _probe(
            "/health", PROBE_PERIOD_S, max(1, role.startup_timeout_s // PROBE_PERIOD_S)
        ),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", PROBE_PERIOD_S, 6),
        # Leave endpoints a moment to drop the pod before the engine starts draining on SIGTERM.
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        "securityContext": _security(spec),
    }
    sidecar = {
        "name": "kv-sidecar",
        "image": spec.sidecar_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": sidecar_command(spec),
        "env": [_downward("POD_IP", "status.podIP")],
        "ports": [
            {"name": "kv", "containerPort": int(spec.kv["port"])},
            {"name": "kv-metrics", "containerPort": sidecar_metrics_port(spec)},
        ],
        "resources": spec.kv.get("sidecarResources") or {"requests": {"cpu": "1", "memory": "2Gi"}},
        "volumeMounts": [
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "kv-auth", "mountPath": KV_AUTH_DIR, "readOnly": True},
        ],
        "readinessProbe": {"tcpSocket": {"port": "kv"}, "periodSeconds": 5},
        "securityContext": _security(spec),
    }
    sched = spec.scheduling
    pod_spec: dict[str, Any] = {
        "containers": [engine, sidecar],
        "volumes": volumes,
        "terminationGracePeriodSeconds": role.termination_grace_s,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {} if spec.features["privileged"] else {"fsGroup": 1000},
    }
    if sched.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(sched["nodeSelector"])
    for key in ("tolerations", "affinity", "topologySpreadConstraints", "priorityClassName"):
        if sched.get(key):
            pod_spec[key] = sched[key]
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    return {"metadata": {"labels": labels}, "spec": pod_spec}
