"""The CRD's ``spec.autoscaling``: SLO targets, bounds per role, loop timing, metrics source.

Each field declared once (``api.fields``): the schema and the typed spec both come from here;
``autoscaling.from_spec.policy_of`` turns the spec into the core's Policy.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from dsv4_operator.api.fields import crd_object, prop, section
from dsv4_operator.api.schema import Schema, boolean, integer, number, obj, string

DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
TIME_PATTERN = r"^([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9])?$"
"""A ``scheduledMinimums`` window's start or end: a UTC time of day."""


def _positive(path: str, what: str) -> tuple[str, str]:
    field = path.rsplit(".", 1)[-1]
    return (
        f"!has(self.{field}) || self.{field} > 0.0",
        f"autoscaling.{path} must be positive ({what})",
    )


def _seconds_cel(field: str) -> str:
    """A time of day as HH:MM:SS in CEL, so 09:00 and 09:00:00 compare equal."""
    return f"(size(self.{field}) == 5 ? self.{field} + ':00' : self.{field})"


def _scheduled_minimums() -> Schema:
    def when(what: str) -> Schema:
        return string(f"{what} (UTC, HH:MM or HH:MM:SS).", pattern=TIME_PATTERN, max_length=8)

    window = obj(
        {
            "name": string(
                "Names the window in events and the last decision.",
                pattern="^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                max_length=63,
            ),
            "start": when("When the floor rises: a new instance's cold start before the peak"),
            "end": when(
                "When it falls back; the usual scale-down follows (stabilisation, drain). "
                "Before start: the window runs past midnight"
            ),
            "days": {
                "type": "array",
                "description": "Weekdays the window starts on; unset: every day.",
                "items": {"type": "string", "enum": list(DAYS)},
                "maxItems": 7,
                "x-kubernetes-list-type": "set",
            },
            "prefill": integer(
                "Fewest prefill instances while the window is on.", minimum=0, maximum=512
            ),
            "decode": integer(
                "Fewest decode instances while the window is on.", minimum=0, maximum=512
            ),
        },
        required=["name", "start", "end"],
        rules=[
            (
                f"{_seconds_cel('start')} != {_seconds_cel('end')}",
                "autoscaling.scheduledMinimums: a window's start and end must differ",
            ),
            (
                "has(self.prefill) || has(self.decode)",
                "autoscaling.scheduledMinimums: a window raises prefill, decode or both "
                "(e.g. prefill: 2)",
            ),
        ],
    )
    return {
        "type": "array",
        "description": "Known peaks: from start to end each day the role's min is raised (never "
        "above max), so capacity is there before the load (a reactive autoscaler loses the "
        "decision and the cold start after a step). Builtin mode only.",
        "items": window,
        "maxItems": 16,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    }


def _min_le_max(role: str) -> tuple[str, str]:
    return ("self.min <= self.max", f"autoscaling.{role}: min must be <= max")


@crd_object(rules=lambda role: [_min_le_max(role)], defaulted=True)
@dataclass(frozen=True)
class Bounds:
    """A role's instance bounds (``ctx``: the role)."""

    min: int = prop(
        lambda role: integer(f"Fewest {role} instances.", default=1, minimum=0, maximum=512)
    )
    max: int = prop(
        lambda role: integer(f"Most {role} instances.", default=4, minimum=0, maximum=512)
    )


@crd_object(
    rules=[
        _min_le_max("prefill"),
        _positive("prefill.tokensPerSecond", "tokens per second, e.g. 20000"),
        _positive("prefill.waitingPerInstance", "queued requests per instance, e.g. 2"),
        _positive("prefill.promptDeadlineSeconds", "seconds, e.g. 0.7 of a 1 s TTFT"),
    ],
    defaulted=True,
)
@dataclass(frozen=True, kw_only=True)
class PrefillScaling(Bounds):
    tokens_per_second: float | None = prop(
        number(
            "Uncached prompt tokens per second one prefill instance serves; unset: learned "
            "from ticks where prefill was saturated."
        )
    )
    waiting_per_instance: float = prop(
        number("Mean prefill queue per instance above which prefill is short.", default=2.0)
    )
    prompt_deadline_s: float | None = prop(
        number(
            "SLO-aware prompt order in the prefill engines (also with autoscaling off): a "
            "prompt's KV is due this many seconds after it reaches its engine (its share "
            "of ttftSeconds: leave the KV transfer and the decode's first step room); the "
            "prompts that can still make it are prefilled first, earliest deadline first, "
            "those that cannot after them in arrival order (still served). Under overload "
            "about capacity/arrival of the prompts then keep the objective instead of almost "
            "none. Unset: first come, first served."
        ),
        key="promptDeadlineSeconds",
    )
    """The prefill engines' ``--prompt-deadline`` (SLO-aware prompt order); None: FCFS."""


@crd_object(
    rules=[
        _min_le_max("decode"),
        (
            "self.kvCacheTarget > 0.0 && self.kvCacheTarget <= 1.0",
            "autoscaling.decode.kvCacheTarget must be in (0, 1] (a fraction of the KV "
            "cache, e.g. 0.8)",
        ),
    ],
    defaulted=True,
)
@dataclass(frozen=True, kw_only=True)
class DecodeScaling(Bounds):
    running_per_instance: int = prop(
        integer(
            "Running sequences per decode instance that meet the TPOT objective, until "
            "enough samples are learned.",
            default=16,
            minimum=1,
        )
    )
    kv_cache_target: float = prop(
        number("KV-cache usage per decode instance to plan for (0..1].", default=0.8)
    )


@crd_object(
    rules=[
        (
            "self.source != 'Prometheus' || has(self.prometheusURL)",
            "autoscaling.metrics.prometheusURL is required when source is "
            "Prometheus (e.g. http://prometheus.monitoring.svc:9090)",
        )
    ],
    defaulted=True,
)
@dataclass(frozen=True, kw_only=True)
class MetricsSource:
    source: str = prop(
        string(
            "Gateway: the gateway pods' /metrics and /instances. Prometheus: PromQL "
            "at prometheusURL.",
            default="Gateway",
            enum=["Gateway", "Prometheus"],
        )
    )
    prometheus_url: str | None = prop(
        string("Prometheus base URL (source Prometheus).", pattern="^https?://", max_length=1024),
        key="prometheusURL",
    )


@crd_object(
    rules=[
        (
            "self.min > 0.0 && self.min <= self.max",
            "autoscaling.prefillDecodeRatio needs 0 < min <= max (prefill instances "
            "per decode instance, e.g. min 0.5, max 2)",
        )
    ],
    description="Optional bounds on prefill:decode instances, kept by raising the smaller role.",
)
@dataclass(frozen=True, kw_only=True)
class Ratio:
    min: float = prop(number("Fewest prefill instances per decode instance."), required=True)
    max: float = prop(number("Most prefill instances per decode instance."), required=True)


@crd_object(
    rules=[
        (
            "!has(self.scheduledMinimums) || self.scheduledMinimums.all(w, "
            "(!has(w.prefill) || w.prefill <= self.prefill.max) && "
            "(!has(w.decode) || w.decode <= self.decode.max))",
            "autoscaling.scheduledMinimums: a window's prefill and decode must not exceed "
            "autoscaling.prefill.max and autoscaling.decode.max",
        ),
        (
            "self.mode == 'Builtin' || !has(self.scheduledMinimums)",
            "autoscaling.scheduledMinimums needs mode Builtin (with External, give the HPA "
            "or KEDA object a schedule, e.g. KEDA's cron trigger)",
        ),
        (
            "self.ttftSeconds > 0.0",
            "autoscaling.ttftSeconds must be a positive number of seconds (the p90 "
            "time-to-first-token objective, e.g. 2)",
        ),
        (
            "!has(self.prefill.promptDeadlineSeconds) || "
            "self.prefill.promptDeadlineSeconds <= self.ttftSeconds",
            "autoscaling.prefill.promptDeadlineSeconds must not exceed ttftSeconds (it is "
            "the prefill engine's share of the TTFT objective)",
        ),
        (
            "self.tpotSeconds > 0.0",
            "autoscaling.tpotSeconds must be a positive number of seconds (the p90 time "
            "per output token objective, e.g. 0.05)",
        ),
    ],
    defaulted=True,
)
@dataclass(frozen=True, kw_only=True)
class AutoscalingSpec:
    """``spec.autoscaling``; ``autoscaling.from_spec.policy_of`` turns it into the core's Policy."""

    enabled: bool = prop(
        boolean(
            "Scale prefill and decode instances from TTFT/TPOT and load (instances: the "
            "initial count, clamped to min/max; the autoscaler owns it afterwards).",
            default=False,
        )
    )
    mode: str = prop(
        string(
            "Builtin: the operator decides. External: an HPA or KEDA sets spec.replicas "
            "of the DeepSeekV4RoleScale {name}-prefill / {name}-decode (scale "
            "subresource); the operator clamps it and drains.",
            default="Builtin",
            enum=["Builtin", "External"],
        )
    )
    ttft_seconds: float = prop(number("TTFT objective (p90, seconds).", default=2.0))
    tpot_seconds: float = prop(number("TPOT objective (p90, seconds).", default=0.05))
    interval_s: int = prop(
        integer("Seconds between decisions.", default=15, minimum=1, maximum=3600),
        key="intervalSeconds",
    )
    window_s: int = prop(
        integer("Seconds of metrics each decision looks at.", default=60, minimum=1, maximum=3600),
        key="windowSeconds",
    )
    stabilization_s: int = prop(
        integer(
            "Scale down only to the highest recommendation of this many seconds.",
            default=300,
            minimum=0,
            maximum=86400,
        ),
        key="scaleDownStabilizationSeconds",
    )
    drain_timeout_s: int = prop(
        integer(
            "Longest wait for a scaled-down instance to move its streams to peers (POST "
            "/drain) and finish the rest before it is deleted anyway.",
            default=120,
            minimum=1,
            maximum=86400,
        ),
        key="drainTimeoutSeconds",
    )
    metrics: MetricsSource = section(MetricsSource)
    prefill_decode_ratio: Ratio | None = section(Ratio)
    npu_budget: int | None = prop(
        integer(
            "Most NPUs the prefill and decode instances may hold together (npusPerNode x "
            "nodes each; CPU instances hold none); scale-ups past it are granted in "
            "proportion to each role's deficit.",
            minimum=1,
        )
    )
    prefill: PrefillScaling = section(PrefillScaling, ctx="prefill")
    decode: DecodeScaling = section(DecodeScaling, ctx="decode")
    scheduled_minimums: tuple[dict[str, Any], ...] = prop(
        _scheduled_minimums(),
        parse=lambda windows: tuple(copy.deepcopy(w) for w in windows),
        absent=(),
    )
    """``scheduledMinimums`` as written (``autoscaling.schedule`` reads the windows)."""

    def bounds(self, role: str) -> Bounds:
        return self.prefill if role == "prefill" else self.decode
