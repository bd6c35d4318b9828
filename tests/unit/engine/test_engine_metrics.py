"""The engine's request events land in vLLM's metric names, exactly (one typed method per
event: a misspelt event is a type error, not a silently dropped metric)."""

from __future__ import annotations

import pytest

from dsv4_common.process import metric_value
from dsv4_serving.engine.core.sched.scheduler import SchedulerStats
from dsv4_serving.engine.engine.observer import EngineObserver
from dsv4_serving.entrypoints.metrics import EngineMetrics


def _metric(m: EngineMetrics, name: str, **labels: str) -> float:
    return metric_value(m.render().decode(), name, **labels)


def test_request_events_become_vllms_histograms_and_counters() -> None:
    m = EngineMetrics("tiny")
    observer: EngineObserver = m
    observer.first_token(0.25, prompt_tokens=7)
    observer.inter_token(0.3, num_tokens=3)  # one speculative step, three tokens
    observer.finished(1.5, "stop", prompt_tokens=7, generation_tokens=4)
    assert _metric(m, "vllm:time_to_first_token_seconds_sum") == 0.25
    assert _metric(m, "vllm:inter_token_latency_seconds_count") == 3
    assert _metric(m, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert _metric(m, "vllm:e2e_request_latency_seconds_sum") == 1.5
    assert _metric(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert _metric(m, "vllm:prompt_tokens_total") == 7
    assert _metric(m, "vllm:generation_tokens_total") == 4


def test_a_steps_shared_gap_counts_as_its_requests_observations() -> None:
    grouped, one_by_one = EngineMetrics("tiny"), EngineMetrics("tiny")
    for seconds, tokens, count in ((0.011, 1, 256), (0.3, 3, 2), (0.02, 1, 1), (99.0, 1, 5)):
        grouped.inter_token(seconds, tokens, count)
        for _ in range(count):
            one_by_one.inter_token(seconds, tokens)

    def buckets(m: EngineMetrics) -> list[str]:
        text = m.render().decode().splitlines()
        return [line for line in text if line.startswith("vllm:inter_token_latency_seconds_b")]

    assert len(buckets(grouped)) > 3 and buckets(grouped) == buckets(one_by_one)
    assert _metric(grouped, "vllm:inter_token_latency_seconds_count") == 256 + 6 + 1 + 5
    total = _metric(one_by_one, "vllm:inter_token_latency_seconds_sum")
    assert _metric(grouped, "vllm:inter_token_latency_seconds_sum") == pytest.approx(total)


def test_aborts_and_kv_errors_are_counted_by_reason() -> None:
    m = EngineMetrics("tiny")
    m.aborted()
    m.kv_error("timeout")
    m.kv_error("timeout")
    m.kv_error("auth")
    assert _metric(m, "dsv4_requests_aborted_total") == 1
    assert _metric(m, "dsv4_kv_request_errors_total", reason="timeout") == 2
    assert _metric(m, "dsv4_kv_request_errors_total", reason="auth") == 1


def test_late_prompts_count_what_each_rank_added() -> None:
    m = EngineMetrics("tiny")
    m.stats(SchedulerStats(num_late_prompts=2), rank=0)
    m.stats(SchedulerStats(num_late_prompts=5), rank=0)
    m.stats(SchedulerStats(num_late_prompts=1), rank=1)
    assert _metric(m, "dsv4_late_prompts_total") == 6
