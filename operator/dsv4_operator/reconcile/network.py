"""Services and NetworkPolicies: clients -> gateway -> engines; sidecar <-> sidecar only."""

from __future__ import annotations

from typing import Any

from dsv4_common.ports import ENGINE_PORT, KV_EVENTS_PORT
from dsv4_operator.api.spec import ROLES, DeploymentSpec, Role
from dsv4_operator.reconcile import names

OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "dsv4", "app.kubernetes.io/component": "operator"}
"""The chart's operator pods (charts/dsv4/templates/_helpers.tpl, dsv4.selectorLabels)."""


def role_service(spec: DeploymentSpec, role: Role) -> dict[str, Any]:
    """Headless: stable DNS per pod, and EndpointSlices the gateway discovers engines from.

    The gateway routes by each endpoint's ``serving`` (the pod's readiness: /ready, so false
    while loading or draining) and ``terminating`` conditions, never by ``ready``, which
    publishNotReadyAddresses pins to true: that stays on only where pods of a multi-node
    instance must resolve each other before they are ready (their rendezvous)."""
    labels = names.role_labels(spec, role)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata(spec, names.role_service_name(spec, role), labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": spec.role(role).nodes_per_instance > 1,
            "selector": names.selector_for(labels),
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": ENGINE_PORT},
                {"name": "kv", "port": spec.kv.port, "targetPort": spec.kv.port},
            ],
        },
    }


def gateway_service(spec: DeploymentSpec) -> dict[str, Any]:
    labels = names.gateway_labels(spec)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata(spec, names.gateway_name(spec), labels),
        "spec": {
            "type": spec.gateway.service_type,
            "selector": names.selector_for(labels),
            "ports": [
                {
                    "name": "http",
                    "port": spec.gateway.port,
                    "targetPort": names.GATEWAY_PORT,
                }
            ],
        },
    }


def _peer(labels: dict[str, str]) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": names.selector_for(labels)}}


def network_policies(spec: DeploymentSpec) -> list[dict[str, Any]]:
    return [_gateway_policy(spec), _engines_policy(spec)]


def _gateway_policy(spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(
            spec, names.gateway_policy_name(spec), names.base_labels(spec, "gateway")
        ),
        "spec": {
            "podSelector": {"matchLabels": names.selector_for(names.gateway_labels(spec))},
            "policyTypes": ["Ingress"],
            # Clients may come from anywhere the Service is exposed to.
            "ingress": [{"ports": [{"protocol": "TCP", "port": names.GATEWAY_PORT}]}],
        },
    }


def _engines_policy(spec: DeploymentSpec) -> dict[str, Any]:
    engines_sel = {
        "matchLabels": {names.DEPLOYMENT_LABEL: spec.name},
        "matchExpressions": [{"key": names.ROLE_LABEL, "operator": "In", "values": list(ROLES)}],
    }
    metrics_ports = [
        {"protocol": "TCP", "port": ENGINE_PORT},
        {"protocol": "TCP", "port": spec.kv.metrics_port},
    ]
    ingress: list[dict[str, Any]] = [
        # engine HTTP API: the gateway only
        {
            "from": [_peer(names.gateway_labels(spec))],
            "ports": [{"protocol": "TCP", "port": ENGINE_PORT}],
        },
        # KV events (PUB and replay of each DP rank, 2 ports per rank): the gateway only
        {"from": [_peer(names.gateway_labels(spec))], "ports": [kv_events_ports(spec)]},
        # KV pulls: sidecars of this deployment only
        {
            "from": [{"podSelector": engines_sel}],
            "ports": [{"protocol": "TCP", "port": spec.kv.port}],
        },
        # Prometheus (any namespace) scrapes the engine's and the sidecar's /metrics
        _from_any_namespace({"app.kubernetes.io/name": "prometheus"}, metrics_ports),
    ]
    if spec.autoscaling.enabled:
        # the autoscaler (the operator's pods, any namespace) reads a draining instance's
        # queue and held KV exports directly
        ingress.append(_from_any_namespace(OPERATOR_POD_LABELS, metrics_ports))
    # collectives inside a multi-node instance (rendezvous, HCCL host sockets)
    ingress += [
        {"from": [_peer({names.DEPLOYMENT_LABEL: spec.name, names.ROLE_LABEL: r})]}
        for r in ROLES
        if spec.role(r).nodes_per_instance > 1
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(
            spec, names.engines_policy_name(spec), names.base_labels(spec, "engine")
        ),
        "spec": {"podSelector": engines_sel, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def kv_events_ports(spec: DeploymentSpec) -> dict[str, Any]:
    """The engines' KV event ports: rank r of an instance publishes on base + 2r, replays on
    base + 2r + 1 (``dsv4_common.kv_events.rank_endpoints``)."""
    ranks = max(spec.role(r).parallelism.dp for r in ROLES)
    return {"protocol": "TCP", "port": KV_EVENTS_PORT, "endPort": KV_EVENTS_PORT + 2 * ranks - 1}


def _from_any_namespace(pod_labels: dict[str, str], ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": pod_labels}}],
        "ports": [dict(p) for p in ports],
    }
