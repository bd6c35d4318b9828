"""What one tick observed: per-role load and the client-side latency quantiles."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4_operator.autoscaling.policy import Role


@dataclass(frozen=True)
class RoleSignals:
    ready: int
    """Instances serving (all pods Ready)."""
    starting: int = 0
    """Instances created and not yet Ready: capacity on its way, not capacity."""
    draining: int = 0
    blocked: int = 0
    """Of the starting ones, those the scheduler cannot place."""
    waiting: float = 0.0
    """Sum over instances of requests waiting for this role's capacity: vllm:num_requests_waiting
    less the decode requests parked until their KV is pulled (they hold their blocks already;
    what they wait for is the prefill side and the transfer, and one such request on a single
    decode instance would otherwise read as a decode queue and scale decode up)."""
    running: float = 0.0
    """Sum over instances of requests running."""
    kv_usage: float = 0.0
    """Sum over instances of KV-cache usage fractions."""
    prompt_tokens_per_s: float = 0.0
    """Uncached prompt tokens per second over the window (prompt minus prefix-cache hits)."""
    prompt_tokens_per_s_recent: float | None = None
    """The same over the last few ticks (None: not measured): scale-up reacts to it, as
    Knative's panic window does, scale-down only to the window's rate."""
    backlog_tokens: float | None = None
    """Uncached prompt tokens the gateways have in flight at this role's instances (None: not
    measured). Over prefill's capacity it is the queueing delay a new prompt meets, and it
    grows from the first second of a load step, where the processed-token rate is capped at
    what the instances already do."""
    latency_p90: float | None = None
    """This role's own p90: prefill engine TTFT for prefill, ITL for decode."""


@dataclass(frozen=True)
class Observations:
    observed_at: float
    roles: dict[Role, RoleSignals]
    ttft_p90: float | None = None
    """Client-side (gateway) p90 TTFT over the window."""
    tpot_p90: float | None = None
    """Client-side p90 inter-token latency over the window."""
    requests: int = 0
    """Requests finished in the window."""
    transfer_p90: float | None = None
    """p90 KV transfer latency (sidecar), for blaming a TTFT breach on the transfer."""
    extra: dict[str, float] = field(default_factory=dict)
