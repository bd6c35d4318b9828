"""Services and NetworkPolicies: clients -> gateway -> engines; sidecar <-> sidecar only."""

from __future__ import annotations

from typing import Any

from dsv4_operator.api.spec import ROLES, DeploymentSpec, Role
from dsv4_operator.reconcile import names


def role_service(spec: DeploymentSpec, role: Role) -> dict[str, Any]:
    """Headless: stable DNS per pod, and EndpointSlices the gateway discovers engines from."""
    labels = names.role_labels(spec, role)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata(spec, names.role_service(spec, role), labels),
        "spec": {
            "clusterIP": "None",
            # Pods of a multi-node instance must resolve each other before they are ready.
            "publishNotReadyAddresses": True,
            "selector": names.selector_for(labels),
            "ports": [
                {"name": "http", "port": names.ENGINE_PORT, "targetPort": names.ENGINE_PORT},
                {"name": "kv", "port": int(spec.kv["port"]), "targetPort": int(spec.kv["port"])},
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
            "type": spec.gateway["serviceType"],
            "selector": names.selector_for(labels),
            "ports": [
                {
                    "name": "http",
                    "port": int(spec.gateway["port"]),
                    "targetPort": names.GATEWAY_PORT,
                }
            ],
        },
    }


def _peer(labels: dict[str, str]) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": names.selector_for(labels)}}


def network_policies(spec: DeploymentSpec) -> list[dict[str, Any]]:
    gw = names.gateway_labels(spec)
    engines_sel = {
        "matchLabels": {names.DEPLOYMENT_LABEL: spec.name},
        "matchExpressions": [{"key": names.ROLE_LABEL, "operator": "In", "values": list(ROLES)}],
    }
    kv_port = int(spec.kv["port"])
    gateway_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(
            spec, f"{spec.name}-gateway", names.base_labels(spec, "gateway")
        ),
        "spec": {
            "podSelector": {"matchLabels": names.selector_for(gw)},
            "policyTypes": ["Ingress"],
            # Clients may come from anywhere the Service is exposed to.
            "ingress": [{"ports": [{"protocol": "TCP", "port": names.GATEWAY_PORT}]}],
        },
    }
    engine_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(spec, f"{spec.name}-engines", names.base_labels(spec, "engine")),
        "spec": {
            "podSelector": engines_sel,
            "policyTypes": ["Ingress"],
            "ingress": [
                # engine HTTP API: the gateway only
                {"from": [_peer(gw)], "ports": [{"protocol": "TCP", "port": names.ENGINE_PORT}]},
                # KV pulls: sidecars of this deployment only
                {
                    "from": [{"podSelector": engines_sel}],
                    "ports": [{"protocol": "TCP", "port": kv_port}],
                },
                # Prometheus (any namespace) scrapes the engine's and the sidecar's /metrics
                {
                    "from": [
                        {
                            "namespaceSelector": {},
                            "podSelector": {
                                "matchLabels": {"app.kubernetes.io/name": "prometheus"}
                            },
                        }
                    ],
                    "ports": [
                        {"protocol": "TCP", "port": names.ENGINE_PORT},
                        {"protocol": "TCP", "port": kv_port + 2},
                    ],
                },
                # collectives inside a multi-node instance (rendezvous, HCCL host sockets)
                *(
                    {
                        "from": [
                            {
                                "podSelector": {
                                    "matchLabels": {
                                        names.DEPLOYMENT_LABEL: spec.name,
                                        names.ROLE_LABEL: r,
                                    }
                                }
                            }
                        ]
                    }
                    for r in ROLES
                    if spec.role(r).nodes_per_instance > 1
                ),
            ],
        },
    }
    return [gateway_policy, engine_policy]


def disruption_budgets(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """At most one engine pod (so one instance) per role down at a time by voluntary eviction."""
    out = []
    for role in ROLES:
        labels = names.role_labels(spec, role)
        out.append(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": names.metadata(spec, f"{spec.name}-{role}", labels),
                "spec": {
                    "maxUnavailable": 1,
                    "selector": {"matchLabels": names.selector_for(labels)},
                },
            }
        )
    if int(spec.gateway["replicas"]) > 1:
        labels = names.gateway_labels(spec)
        out.append(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": names.metadata(spec, names.gateway_name(spec), labels),
                "spec": {
                    "maxUnavailable": 1,
                    "selector": {"matchLabels": names.selector_for(labels)},
                },
            }
        )
    return out
