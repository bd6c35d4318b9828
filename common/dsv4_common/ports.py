"""Ports a deployment derives from one another, named once: the operator renders them into
pods, ``dsv4 up`` hands them out, the sidecar defaults to them."""

from __future__ import annotations

ENGINE_PORT = 8000
"""The engine's OpenAI API and /metrics in a pod: the operator renders it and reads it there."""
KV_PORT = 14579
"""The KV sidecar's peer port (remote sidecars pull from it)."""
KV_EVENTS_PORT = 5557
"""The engine's KV events in a pod (vLLM's and llm-d's port): DP rank r publishes on this + 2r
and serves replay on this + 2r + 1; the operator renders it, the gateway dials it."""
SIDECAR_CONTROL_OFFSET = 1
"""The sidecar's control API listens at the peer port + this, on 127.0.0.1 (the engine beside
it is its only client)."""
SIDECAR_METRICS_OFFSET = 2
"""The sidecar's /health and /metrics for Prometheus: the peer port + this (the control API
stays private)."""


def sidecar_control_port(kv_port: int) -> int:
    return kv_port + SIDECAR_CONTROL_OFFSET


def sidecar_metrics_port(kv_port: int) -> int:
    return kv_port + SIDECAR_METRICS_OFFSET
