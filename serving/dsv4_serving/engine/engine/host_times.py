"""Host time per engine step, by phase: what the engine's Python costs around each device step
(``docs/engine.md``, "Host overhead per step"). Pure Python.

The core times three spans of every step with ``time.perf_counter`` and sends them with the
step's stats (``SchedulerStats.host_spans``): **schedule** (the scheduler and the KV
connector's calls before the forward), **prepare** (the runner's input preparation: token ids,
positions, block tables, attention metadata), **post-process** (the scheduler's update from
the step's results, KV saves and events, the stats). The front end times the fourth,
**stream** (detokenising, stop strings and handing each request its increment), once per step
message. ``HostTimes`` keeps the last ``window`` samples of each and reports p50 / p99 in
milliseconds (``GET /debug/host_times``).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

PHASES = ("schedule", "prepare", "post_process", "stream")


class StepSpans(NamedTuple):
    """One step's core-side host time, seconds."""

    schedule: float
    prepare: float
    post_process: float


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of an ascending list; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil(n q / 100), at least the first
    return sorted_values[int(rank) - 1]


class HostTimes:
    def __init__(self, window: int = 8192) -> None:
        self._samples: dict[str, deque[float]] = {p: deque(maxlen=window) for p in PHASES}

    def add_step(self, spans: StepSpans) -> None:
        self._samples["schedule"].append(spans.schedule)
        self._samples["prepare"].append(spans.prepare)
        self._samples["post_process"].append(spans.post_process)

    def add_stream(self, seconds: float) -> None:
        self._samples["stream"].append(seconds)

    def reset(self) -> None:
        for d in self._samples.values():
            d.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: ``count``, ``p50_ms``, ``p99_ms``, ``mean_ms``."""
        out: dict[str, dict[str, float]] = {}
        for phase, d in self._samples.items():
            values = sorted(d)
            n = len(values)
            out[phase] = {
                "count": n,
                "p50_ms": 1e3 * percentile(values, 50),
                "p99_ms": 1e3 * percentile(values, 99),
                "mean_ms": 1e3 * sum(values) / n if n else 0.0,
            }
        return out
