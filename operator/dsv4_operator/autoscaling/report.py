"""What a decision looks like to a user: status fields, conditions, the printer column, events
and the operator's own metrics. Pure, except the metric objects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import Counter, Gauge

from dsv4_operator.autoscaling.decide import Decision
from dsv4_operator.autoscaling.drain import Drain
from dsv4_operator.autoscaling.policy import ROLES

DESIRED = Gauge(
    "dsv4_autoscaler_desired_instances",
    "Instances the autoscaler asks for",
    ["namespace", "deployment", "role"],
)
SIGNAL = Gauge(
    "dsv4_autoscaler_signal",
    "Signals the last decision used",
    ["namespace", "deployment", "role", "signal"],
)
DECISIONS = Counter(
    "dsv4_autoscaler_decisions",
    "Autoscaler decisions that moved a role",
    ["namespace", "deployment", "role", "direction"],
)
METRICS_AGE = Gauge(
    "dsv4_autoscaler_metrics_age_seconds",
    "Age of the observations the last decision used",
    ["namespace", "deployment"],
)


def autoscaling_status(
    decision: Decision,
    drains: Sequence[Drain],
    *,
    source: str,
    observed_at: str | None,
    last_scale_time: str | None,
) -> dict[str, Any]:
    """``status.autoscaling``: what the autoscaler saw and decided, per role."""
    out: dict[str, Any] = {
        "active": decision.active.status == "True",
        "source": source,
        "lastDecision": decision.summary,
    }
    if observed_at is not None:
        out["observedAt"] = observed_at
    if last_scale_time is not None:
        out["lastScaleTime"] = last_scale_time
    for role in ROLES:
        d = decision.roles[role]
        out[role] = {
            "current": d.current,
            "recommended": d.recommended,
            "target": d.target,
            "reason": d.reason,
            "draining": sorted(x.instance for x in drains if x.role == role),
            "signals": {k: _fmt(v) for k, v in sorted(d.signals.items())},
        }
    return out


def latency_status(decision: Decision) -> dict[str, str]:
    """``status.metrics``: the p90 TTFT and TPOT the printer columns show."""
    out = {}
    ttft = decision.roles["prefill"].signals.get("ttftP90")
    tpot = decision.roles["decode"].signals.get("tpotP90")
    if ttft is not None:
        out["ttft"] = f"{ttft:.3g}s"
    if tpot is not None:
        out["tpot"] = f"{tpot * 1e3:.3g}ms"
    return out


def conditions(decision: Decision) -> list[tuple[str, str, str, str]]:
    """(type, status, reason, message) of AutoscalingActive and ScalingLimited."""
    a, lim = decision.active, decision.limited
    return [
        ("AutoscalingActive", a.status, a.reason, a.message),
        ("ScalingLimited", lim.status, lim.reason, lim.message),
    ]


def record_metrics(
    namespace: str, deployment: str, decision: Decision, age_s: float | None
) -> None:
    for role in ROLES:
        d = decision.roles[role]
        DESIRED.labels(namespace, deployment, role).set(d.target)
        for name, value in d.signals.items():
            SIGNAL.labels(namespace, deployment, role, name).set(value)
        if d.direction != "hold":
            DECISIONS.labels(namespace, deployment, role, d.direction).inc()
    if age_s is not None:
        METRICS_AGE.labels(namespace, deployment).set(age_s)


def _fmt(v: float) -> str:
    """Status fields are strings: a CRD cannot hold a float that JSON may print as 1e-05."""
    return f"{v:.4g}"


def disabled_conditions() -> list[tuple[str, str, str, str]]:
    msg = "spec.autoscaling.enabled is false: instance counts come from spec"
    return [
        ("AutoscalingActive", "False", "Disabled", msg),
        ("ScalingLimited", "False", "Disabled", msg),
    ]


def events_of(decision: Decision) -> Mapping[str, list[tuple[str, str]]]:
    """Events by type ("Normal"/"Warning") -> [(reason, message)]."""
    out: dict[str, list[tuple[str, str]]] = {"Normal": [], "Warning": []}
    for e in decision.events:
        out[e.type].append((e.reason, e.message))
    return out
