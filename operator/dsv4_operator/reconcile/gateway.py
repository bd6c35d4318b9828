"""The gateway: Deployment, Service account and the RBAC to watch engine EndpointSlices."""

from __future__ import annotations

from typing import Any

from dsv4_common.ports import KV_EVENTS_PORT
from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.reconcile import names
from dsv4_operator.reconcile.shutdown import gateway_shutdown
from dsv4_operator.reconcile.tracing import tracing_args


def gateway_command(spec: DeploymentSpec) -> list[str]:
    return [
        "dsv4",
        "gateway",
        "--host",
        "0.0.0.0",
        "--port",
        str(names.GATEWAY_PORT),
        "--policy",
        spec.gateway.routing_policy,
        "--served-model-name",
        spec.model.served_name,
        "--discovery",
        "kubernetes",
        "--namespace",
        spec.namespace,
        "--selector",
        f"{names.DEPLOYMENT_LABEL}={spec.name}",
        "--shutdown-timeout",
        str(gateway_shutdown(spec).drain_s),
        # the autoscaler's drains (absent unless autoscaled: then nothing drains); always named,
        # so turning autoscaling on does not roll the gateway
        "--routing-configmap",
        names.routing_name(spec),
        # the precise prefix index: every engine pod publishes its KV events on this port
        "--kv-events-port",
        str(KV_EVENTS_PORT),
        *tracing_args(spec),
    ]


def gateway_objects(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The gateway's ServiceAccount, its Role and RoleBinding, and its Deployment."""
    labels = names.gateway_labels(spec)
    name = names.gateway_name(spec)
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": names.metadata(spec, name, labels),
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": names.metadata(spec, name, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": spec.namespace}],
    }
    return [account, _gateway_role(spec, name, labels), binding, _deployment(spec, name, labels)]


def _gateway_role(spec: DeploymentSpec, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": names.metadata(spec, name, labels),
        "rules": [
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            },
            {
                # the instances the autoscaler drains (watch with fieldSelector metadata.name)
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [names.routing_name(spec)],
                "verbs": ["get", "list", "watch"],
            },
        ],
    }


def _deployment(spec: DeploymentSpec, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": names.metadata(spec, name, labels),
        "spec": {
            "replicas": spec.gateway.replicas,
            "selector": {"matchLabels": names.selector_for(labels)},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": name,
                    "terminationGracePeriodSeconds": gateway_shutdown(spec).grace_s,
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
                    "containers": [_container(spec)],
                },
            },
        },
    }


def _container(spec: DeploymentSpec) -> dict[str, Any]:
    env: list[dict[str, Any]] = []
    if secret := spec.gateway.api_key_secret:
        env.append(
            {
                "name": "DSV4_GATEWAY_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}},
            }
        )
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
    return {
        "name": "gateway",
        "image": spec.gateway.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": gateway_command(spec),
        "env": env,
        "ports": [{"name": "http", "containerPort": names.GATEWAY_PORT}],
        "resources": spec.gateway.resources or {"requests": {"cpu": "1", "memory": "1Gi"}},
        # /ready fails as soon as it drains (SIGTERM); /health only if stuck
        "readinessProbe": {**probe, "httpGet": {"path": "/ready", "port": "http"}},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "lifecycle": gateway_shutdown(spec).lifecycle(),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
    }
