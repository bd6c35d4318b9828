from __future__ import annotations

import math

import pytest

from dsv4_serving.bench.stats import RequestRecord, format_table, percentile, summarize


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert math.isnan(percentile([], 50))


def test_summary_counts_tpot_goodput_and_failures() -> None:
    recs = [
        RequestRecord(
            ok=True, prompt_tokens=10, output_tokens=11, ttft=0.1, e2e=1.1, itl=[0.1] * 10
        ),  # tpot 0.1
        RequestRecord(
            ok=True, prompt_tokens=10, output_tokens=11, ttft=0.5, e2e=0.7, itl=[0.02] * 10
        ),  # tpot 0.02
        RequestRecord(ok=True, prompt_tokens=10, output_tokens=1, ttft=0.05, e2e=0.05),  # no tpot
        RequestRecord(ok=False, error="HTTP 503: x"),
    ]
    s = summarize(recs, duration_s=2.0, ttft_slo=0.2, tpot_slo=0.05)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["errors"] == ["HTTP 503: x"]
    assert s["output_token_throughput"] == 23 / 2.0
    assert s["tpot_s"]["mean"] == pytest.approx(0.06)
    # only the single-token answer meets both objectives (first is too slow per token, second too late)
    assert s["goodput"] == 0.5
    assert "goodput" in format_table(s) and "TTFT" in format_table(s)
