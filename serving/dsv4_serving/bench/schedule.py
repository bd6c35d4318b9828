"""``--schedule "60s@0.5,120s@4,90s@0.5"``: request-rate steps (seconds at requests per second),
turned into Poisson arrival times, so an autoscaler's reaction can be lined up per phase."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

MAX_ARRIVALS = 100_000
_STEP = re.compile(r"^\s*(\d+(?:\.\d+)?)(s|m)\s*@\s*(\d+(?:\.\d+)?)\s*$")


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Phase:
    seconds: float
    rate: float
    """Requests per second (0: a quiet phase)."""


def parse_schedule(text: str) -> list[Phase]:
    phases = []
    for part in text.split(","):
        m = _STEP.match(part)
        if not m:
            raise ScheduleError(
                f"--schedule step {part.strip()!r} is not DURATION@RATE (e.g. 60s@0.5 or 2m@4)"
            )
        seconds = float(m.group(1)) * (60 if m.group(2) == "m" else 1)
        if seconds <= 0:
            raise ScheduleError(f"--schedule step {part.strip()!r} lasts no time")
        phases.append(Phase(seconds, float(m.group(3))))
    return phases


def arrivals(phases: list[Phase], seed: int) -> list[tuple[float, int]]:
    """(seconds from the start, phase index) of every request: a Poisson process per phase."""
    rng = random.Random(seed)
    out: list[tuple[float, int]] = []
    start = 0.0
    for i, ph in enumerate(phases):
        t = start
        end = start + ph.seconds
        while ph.rate > 0:
            t += rng.expovariate(ph.rate)
            if t >= end:
                break
            out.append((t, i))
            if len(out) > MAX_ARRIVALS:
                raise ScheduleError(f"--schedule asks for more than {MAX_ARRIVALS} requests")
        start = end
    return out
