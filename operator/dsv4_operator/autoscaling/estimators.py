"""Capacities learned online: prefill tokens/s per instance and the decode batch that meets TPOT.

Both only raise a recommendation on top of the SLO and queue signals, so a noisy estimate at
low traffic cannot shrink a role below what its latency needs.
"""

from __future__ import annotations

import math

EWMA = 0.3
MAX_SAMPLES = 50
MIN_SAMPLES = 5


def learn_prefill_capacity(
    old: float | None, tokens_per_s: float, waiting: float, ready: int, breach: bool
) -> float | None:
    """Per-instance prefill capacity, from ticks where every instance had work queued (only
    then is the observed rate what the instances can do, not what arrived) or where TTFT broke
    its objective because of prefill (the rate the instances can take within the SLO)."""
    if ready <= 0 or tokens_per_s <= 0 or (waiting < ready and not breach):
        return old
    sample = tokens_per_s / ready
    return sample if old is None else (1 - EWMA) * old + EWMA * sample


def add_sample(
    samples: tuple[tuple[float, float], ...], running_per_instance: float, itl: float | None
) -> tuple[tuple[float, float], ...]:
    if itl is None or running_per_instance <= 0:
        return samples
    return (*samples, (running_per_instance, itl))[-MAX_SAMPLES:]


def batch_target(
    samples: tuple[tuple[float, float], ...],
    tpot_s: float,
    headroom: float,
    default: int,
    max_num_seqs: int,
) -> float:
    """B* from a least-squares fit ``itl = a + b * running``: the batch whose step time is
    ``headroom * tpot``. The default until the fit has enough spread and a positive slope."""
    if len(samples) < MIN_SAMPLES:
        return float(default)
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    sxx = sum((x - mx) ** 2 for x, _ in samples)
    if sxx <= 1e-12:
        return float(default)
    b = sum((x - mx) * (y - my) for x, y in samples) / sxx
    a = my - b * mx
    if b <= 0:
        return float(default)
    return min(float(max_num_seqs), max(1.0, (headroom * tpot_s - a) / b))


def ceil_div(x: float, y: float) -> int:
    """``ceil(x / y)`` for a non-negative load and a positive capacity, robust to float noise."""
    if x <= 0:
        return 0
    return math.ceil(x / y - 1e-9)
