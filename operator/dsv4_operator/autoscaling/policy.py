"""What the autoscaler aims for: the SLOs, the bounds, and how cautiously it moves.

Defaults follow the autoscalers users already know (HPA's 15 s sync and 300 s scale-down
stabilisation, Dynamo's 0.8 scale-down sensitivity, Knative's panic threshold).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dsv4_operator.autoscaling.schedule import ScheduledMinimum

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")


@dataclass(frozen=True)
class RoleBounds:
    min: int
    max: int

    def clamp(self, n: int) -> int:
        return max(self.min, min(self.max, n))


@dataclass(frozen=True)
class Policy:
    ttft_s: float
    """p90 time-to-first-token objective."""
    tpot_s: float
    """p90 time-per-output-token objective."""
    bounds: dict[Role, RoleBounds] = field(
        default_factory=lambda: {"prefill": RoleBounds(1, 1), "decode": RoleBounds(1, 1)}
    )
    interval_s: float = 15.0
    window_s: float = 60.0
    stabilization_s: float = 300.0
    """Scale-down takes the highest recommendation over this long (HPA's window)."""
    max_age_s: float = 30.0
    """Observations older than this hold the current size (stale-metrics trap)."""
    utilization: float = 0.8
    """Fraction of an instance's learned prefill capacity the autoscaler plans to use."""
    kv_target: float = 0.8
    """Decode KV-cache usage per instance the autoscaler plans for."""
    headroom: float = 0.9
    """Decode batch target is sized for headroom x the TPOT objective."""
    waiting_per_instance: float = 2.0
    """Mean prefill queue per instance above which prefill is short."""
    decode_waiting_per_instance: float = 0.5
    backlog_ttft_fraction: float = 0.5
    """Prefill is short when its backlog (in-flight prompt tokens over the instances' capacity)
    would delay a new prompt by more than this fraction of the TTFT objective."""
    running_per_instance: int = 16
    """Decode batch target until enough (running, TPOT) samples are learned."""
    prefill_tokens_per_s: float | None = None
    """Per-instance uncached prompt-token capacity; learned from saturated ticks when unset."""
    min_requests: int = 20
    """Fewer finished requests in the window: latency quantiles are not trusted."""
    breach_ticks: int = 2
    """Consecutive short ticks before a scale-up (unless the breach is >= panic x the target)."""
    panic: float = 1.5
    scale_down_margin: float = 0.8
    """Scale down only while latency is below this fraction of the objective."""
    ratio: tuple[float, float] | None = None
    """Optional prefill:decode instance ratio bounds (min, max), kept by raising a role."""
    max_num_seqs: int = 256
    npu_budget: int | None = None
    """Most NPUs both roles' instances may hold together; increases past it are granted in
    proportion to each role's deficit (Dynamo's ``max_gpu_budget``)."""
    npus_per_instance: dict[Role, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    """NPUs one instance of each role holds (npusPerNode x nodes; 0 on CPU)."""
    scheduled: tuple[ScheduledMinimum, ...] = ()
    """Windows that raise a role's min ahead of a known peak (``autoscaling/schedule.py``)."""
