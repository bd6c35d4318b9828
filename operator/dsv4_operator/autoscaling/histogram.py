"""Windowed quantiles from cumulative Prometheus histogram snapshots.

The gateway exports cumulative bucket counts; the autoscaler keeps a snapshot per tick and
takes the quantile of the difference over its window, with Prometheus' own interpolation
(``histogram_quantile``), so the figure agrees with a PromQL query over the same window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

Buckets = Mapping[float, float]
"""Upper bound (``le``, ``math.inf`` for +Inf) -> cumulative count."""


def delta(new: Buckets, old: Buckets | None) -> dict[float, float]:
    """``new - old`` per bucket; a bucket that went down means the source restarted, so the
    new snapshot alone is the window (as PromQL's ``rate`` treats a counter reset)."""
    if old is None or any(new.get(le, 0.0) < old.get(le, 0.0) for le in old):
        return dict(new)
    return {le: new[le] - old.get(le, 0.0) for le in new}


def count(buckets: Buckets) -> float:
    return buckets.get(math.inf, max(buckets.values(), default=0.0))


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus ``histogram_quantile``: linear within the bucket holding rank ``q * count``;
    a rank in the +Inf bucket answers the highest finite bound. None when empty."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    les = sorted(buckets)
    total = count(buckets)
    if not les or total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in les:
        c = buckets[le]
        if c >= rank:
            if math.isinf(le):
                return lower
            if c == below:
                return le
            return lower + (le - lower) * (rank - below) / (c - below)
        lower, below = le, c
    return lower


def bucket_of(value: float, bounds: list[float]) -> int:
    """Index of the bucket a value falls in (``value <= le``), for "within one bucket" checks."""
    for i, le in enumerate(sorted(bounds)):
        if value <= le:
            return i
    return len(bounds)
