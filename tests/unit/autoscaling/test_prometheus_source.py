"""PromQL the Prometheus source sends and how it reads the answers (the real server is used
by the gateway tier's source-agreement test)."""

from __future__ import annotations

import pytest

from dsv4_operator.autoscaling.gateway_source import RoleCounts
from dsv4_operator.autoscaling.prometheus_source import (
    PrometheusError,
    Queries,
    observations,
    scalar,
)

COUNTS = {"prefill": RoleCounts(ready=1), "decode": RoleCounts(ready=2, draining=1)}


def vector(*values: str) -> dict[str, object]:
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": {}, "value": [1.0, v]} for v in values],
        },
    }


def test_queries_select_the_deployment_and_role() -> None:
    q = Queries("v4", "ml", window_s=60).all()
    assert q["ttft_p90"] == (
        "histogram_quantile(0.9, sum by (le) (rate({"
        '__name__=~"vllm[:_]time_to_first_token_seconds_bucket",'
        'dsv4_deployment="v4",namespace="ml",component="gateway"}[60s])))'
    )
    assert q["decode_running"] == (
        'sum({__name__=~"vllm[:_]num_requests_running",'
        'dsv4_deployment="v4",namespace="ml",component="engine",role="decode"})'
    )
    assert q["decode_waiting"] == (
        'sum({__name__=~"vllm[:_]num_requests_waiting",'
        'dsv4_deployment="v4",namespace="ml",component="engine",role="decode"}) - '
        '(sum({__name__="dsv4_kv_requests_waiting_for_remote_kv",'
        'dsv4_deployment="v4",namespace="ml",component="engine",role="decode"}) or vector(0))'
    )
    assert q["prefill_waiting"] == (
        'sum({__name__=~"vllm[:_]num_requests_waiting",'
        'dsv4_deployment="v4",namespace="ml",component="engine",role="prefill"})'
    )
    assert "prefix_cache_hits_total" in q["prefill_prompt_tokens_per_s"]
    assert len(q) == 4 + 4 * 2


def test_scalar_reads_one_sample_and_treats_nan_and_empty_as_missing() -> None:
    assert scalar(vector("1.5")) == 1.5
    assert scalar(vector("NaN")) is None
    assert scalar(vector()) is None
    assert (
        scalar({"status": "success", "data": {"resultType": "scalar", "result": [1.0, "2"]}}) == 2.0
    )
    with pytest.raises(PrometheusError, match="one series"):
        scalar(vector("1", "2"))
    with pytest.raises(PrometheusError, match="bad_data: parse error"):
        scalar({"status": "error", "errorType": "bad_data", "error": "parse error"})
    with pytest.raises(PrometheusError, match="instant vector"):
        scalar({"status": "success", "data": {"resultType": "matrix", "result": []}})


def test_observations_from_values() -> None:
    values: dict[str, float | None] = {
        "newest": 100.0,
        "ttft_p90": 0.8,
        "tpot_p90": None,
        "requests": 41.6,
        "prefill_waiting": 2.0,
        "prefill_prompt_tokens_per_s": -0.5,  # rate difference below zero after a reset
        "decode_running": 12.0,
        "decode_kv_usage": 0.9,
    }
    obs = observations(values, COUNTS)
    assert obs is not None
    assert (obs.observed_at, obs.ttft_p90, obs.tpot_p90, obs.requests) == (100.0, 0.8, None, 42)
    assert obs.roles["prefill"].waiting == 2.0
    assert obs.roles["prefill"].prompt_tokens_per_s == 0.0
    assert (obs.roles["decode"].running, obs.roles["decode"].draining) == (12.0, 1)
    assert observations({"newest": None}, COUNTS) is None
