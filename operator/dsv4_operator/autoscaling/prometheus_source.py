"""The optional metrics source: PromQL over vLLM's metric names (Dynamo's planner, llm-d's
KEDA path and WVA read the same way).

Series are selected by the labels the chart's PodMonitor gives every scraped pod:
``dsv4_deployment``, ``namespace``, ``component`` (gateway | engine) and ``role``. Building the
queries and reading the answers is pure; the loop does the HTTP GETs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsv4_operator.autoscaling.gateway_source import RoleCounts
from dsv4_operator.autoscaling.policy import ROLES, Role
from dsv4_operator.autoscaling.signals import Observations, RoleSignals


class PrometheusError(Exception):
    """The server answered something other than a successful instant vector."""


@dataclass(frozen=True)
class Queries:
    deployment: str
    namespace: str
    window_s: float
    quantile: float = 0.9

    def _m(self, name: str, component: str, role: str | None = None) -> str:
        """A series selector. vLLM's names have a colon (``vllm:...``), which OpenMetrics
        scrapes may store as an underscore (prometheus_client >= 0.21 escapes it when the server
        does not ask for UTF-8 names), so either spelling matches."""
        prefix, colon, rest = name.partition(":")
        labels = [
            f'__name__=~"{prefix}[:_]{rest}"' if colon else f'__name__="{name}"',
            f'dsv4_deployment="{self.deployment}"',
            f'namespace="{self.namespace}"',
            f'component="{component}"',
        ]
        if role is not None:
            labels.append(f'role="{role}"')
        return "{" + ",".join(labels) + "}"

    def all(self) -> dict[str, str]:
        """Name -> PromQL; every one answers a single-sample (or empty) instant vector."""
        w = f"[{int(self.window_s)}s]"
        q = {
            "ttft_p90": f"histogram_quantile({self.quantile}, sum by (le) "
            f"(rate({self._m('vllm:time_to_first_token_seconds_bucket', 'gateway')}{w})))",
            "tpot_p90": f"histogram_quantile({self.quantile}, sum by (le) "
            f"(rate({self._m('vllm:inter_token_latency_seconds_bucket', 'gateway')}{w})))",
            "requests": "sum(increase("
            f"{self._m('vllm:time_to_first_token_seconds_count', 'gateway')}{w}))",
            "newest": f"max(timestamp({self._m('vllm:num_requests_running', 'engine')}))",
        }
        for role in ROLES:

            def m(name: str, role: str = role) -> str:
                return self._m(name, "engine", role)

            q[f"{role}_waiting"] = f"sum({m('vllm:num_requests_waiting')})"
            if role == "decode":  # less those parked for their KV (RoleSignals.waiting)
                q[f"{role}_waiting"] += (
                    f" - (sum({m('dsv4_kv_requests_waiting_for_remote_kv')}) or vector(0))"
                )
            q[f"{role}_running"] = f"sum({m('vllm:num_requests_running')})"
            q[f"{role}_kv_usage"] = f"sum({m('vllm:kv_cache_usage_perc')})"
            q[f"{role}_prompt_tokens_per_s"] = (
                f"sum(rate({m('vllm:prompt_tokens_total')}{w})) - "
                f"sum(rate({m('vllm:prefix_cache_hits_total')}{w}))"
            )
        return q


def scalar(answer: Mapping[str, Any]) -> float | None:
    """The value of a ``/api/v1/query`` answer holding one sample; None when empty or NaN."""
    if answer.get("status") != "success":
        raise PrometheusError(f"query failed: {answer.get('errorType')}: {answer.get('error')}")
    data = answer.get("data", {})
    if data.get("resultType") not in ("vector", "scalar"):
        raise PrometheusError(f"expected an instant vector, got {data.get('resultType')}")
    result = data.get("result", [])
    if data["resultType"] == "scalar":
        result = [{"value": result}]
    if not result:
        return None
    if len(result) > 1:
        raise PrometheusError(f"expected one series, got {len(result)}")
    value = float(result[0]["value"][1])
    return None if math.isnan(value) else value


def observations(
    values: Mapping[str, float | None], counts: Mapping[Role, RoleCounts]
) -> Observations | None:
    """One tick from the query values; None when no engine series exists at all."""
    newest = values.get("newest")
    if newest is None:
        return None
    roles: dict[Role, RoleSignals] = {}
    for role in ROLES:
        c = counts[role]
        roles[role] = RoleSignals(
            ready=c.ready,
            starting=c.starting,
            draining=c.draining,
            blocked=c.blocked,
            waiting=values.get(f"{role}_waiting") or 0.0,
            running=values.get(f"{role}_running") or 0.0,
            kv_usage=values.get(f"{role}_kv_usage") or 0.0,
            prompt_tokens_per_s=max(0.0, values.get(f"{role}_prompt_tokens_per_s") or 0.0),
        )
    return Observations(
        observed_at=newest,
        roles=roles,
        ttft_p90=values.get("ttft_p90"),
        tpot_p90=values.get("tpot_p90"),
        requests=round(values.get("requests") or 0.0),
    )
