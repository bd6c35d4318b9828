from __future__ import annotations

import math

import pytest

from dsv4_operator.autoscaling.histogram import bucket_of, count, delta, quantile

INF = math.inf


def test_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    # 10 observations: 2 in (0, 0.1], 6 in (0.1, 0.5], 2 in (0.5, 1]
    b = {0.1: 2.0, 0.5: 8.0, 1.0: 10.0, INF: 10.0}
    assert quantile(0.5, b) == pytest.approx(0.1 + 0.4 * 3 / 6)
    assert quantile(0.9, b) == pytest.approx(0.5 + 0.5 * 1 / 2)
    assert quantile(0.1, b) == pytest.approx(0.05)


def test_rank_in_the_inf_bucket_answers_the_highest_finite_bound() -> None:
    assert quantile(0.99, {0.1: 1.0, 0.5: 2.0, INF: 10.0}) == 0.5


def test_empty_window_has_no_quantile() -> None:
    assert quantile(0.9, {0.1: 0.0, INF: 0.0}) is None
    assert quantile(0.9, {}) is None
    with pytest.raises(ValueError, match="outside"):
        quantile(1.5, {INF: 1.0})


def test_window_is_the_difference_of_snapshots() -> None:
    old = {0.1: 5.0, 0.5: 10.0, INF: 12.0}
    new = {0.1: 5.0, 0.5: 18.0, INF: 20.0}
    d = delta(new, old)
    assert d == {0.1: 0.0, 0.5: 8.0, INF: 8.0}
    assert count(d) == 8.0
    assert quantile(0.5, d) == pytest.approx(0.1 + 0.4 * 4 / 8)


def test_counter_reset_takes_the_new_snapshot_alone() -> None:
    old = {0.1: 5.0, INF: 12.0}
    new = {0.1: 1.0, INF: 2.0}
    assert delta(new, old) == new
    assert delta(new, None) == new


def test_bucket_of() -> None:
    bounds = [0.1, 0.5, 1.0]
    assert [bucket_of(v, bounds) for v in (0.05, 0.1, 0.2, 0.9, 3.0)] == [0, 0, 1, 2, 3]
