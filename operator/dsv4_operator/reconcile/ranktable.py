"""HCCL rank tables: one per instance, from the NPUs the device plugin gave each pod.

The table is ``completed`` only when every pod of the instance is placed and annotated; until
then it is ``initializing`` and the engines wait. Ranks follow node rank (pod index), then the
device order the plugin reported, so rank r lives on pod r // npus_per_node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dsv4_operator.reconcile.errors import ReconcileError

# The device plugin's annotation is the cluster's fact, not the user's spec.
_REASON = "InvalidPlacement"


@dataclass(frozen=True)
class PodPlacement:
    """What the operator observed of one engine pod."""

    name: str
    node_rank: int
    node_name: str | None
    host_ip: str | None
    devices_annotation: str | None  # JSON from the Ascend device plugin, or None


def parse_devices(annotation: str) -> list[dict[str, str]]:
    """Devices from the plugin's annotation: ``{"devices": [{"device_id", "device_ip"}, ...]}``."""
    try:
        data = json.loads(annotation)
    except json.JSONDecodeError as e:
        raise ReconcileError(f"device annotation is not JSON: {e}", _REASON) from None
    devices = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(devices, list):
        raise ReconcileError("annotation has no 'devices' list", _REASON)
    out = []
    for d in devices:
        if not isinstance(d, dict) or "device_id" not in d or "device_ip" not in d:
            raise ReconcileError(f"device entry lacks device_id/device_ip: {d!r}", _REASON)
        out.append({"device_id": str(d["device_id"]), "device_ip": str(d["device_ip"])})
    return out


def rank_table(
    pods: list[PodPlacement], nodes_per_instance: int, npus_per_node: int
) -> dict[str, Any]:
    """The hccl.json of one instance (version 1.0 format)."""
    by_rank = {p.node_rank: p for p in pods}
    placed = all(
        r in by_rank
        and by_rank[r].node_name
        and by_rank[r].host_ip
        and by_rank[r].devices_annotation
        for r in range(nodes_per_instance)
    )
    if not placed:
        return {"version": "1.0", "status": "initializing", "server_count": "0", "server_list": []}
    servers = []
    rank = 0
    for r in range(nodes_per_instance):
        pod = by_rank[r]
        assert pod.devices_annotation is not None
        devices = parse_devices(pod.devices_annotation)
        if len(devices) != npus_per_node:
            raise ReconcileError(
                f"pod {pod.name} got {len(devices)} NPUs from the device plugin, "
                f"expected {npus_per_node}",
                _REASON,
            )
        entries = []
        for d in devices:
            entries.append({**d, "rank_id": str(rank)})
            rank += 1
        servers.append({"server_id": pod.host_ip, "device": entries, "host_nic_ip": "reserve"})
    return {
        "version": "1.0",
        "status": "completed",
        "server_count": str(len(servers)),
        "server_list": servers,
    }
