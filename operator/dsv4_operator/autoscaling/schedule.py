"""Scheduled minimums (``autoscaling.scheduledMinimums``): a role's floor raised ahead of a known
peak, pure.

A reactive autoscaler loses the seconds from a load step to a new instance's first request (the
decision plus the cold start, minutes for a real DeepSeek V4 instance): nothing it observes
announces the step. Users with daily peaks know them, so a window raises ``min`` from its start
(set it a cold start early) to its end, the way KEDA's cron scaler does; ``decide`` scales up to
the raised floor at once, and after the window the usual scale-down (stabilisation, consolidation,
drain) brings the role back. Times are UTC, daily, optionally on some weekdays only; a window
whose end is before its start runs past midnight (its weekday is the one it starts on).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dsv4_operator.api.autoscaling_spec import DAYS, TIME_PATTERN


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class ScheduledMinimum:
    name: str
    start_s: int
    """Seconds after midnight UTC."""
    end_s: int
    days: frozenset[int]
    """Weekdays the window starts on (0 = Monday); empty: every day."""
    minimums: Mapping[str, int]
    """Role -> the lowest instance count while the window is on."""

    def active(self, now: float) -> bool:
        t = time.gmtime(now)
        sod, day = t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec, t.tm_wday
        if self.start_s < self.end_s:
            return self.start_s <= sod < self.end_s and self._on(day)
        # past midnight: the evening part on its own day, the morning part on the next
        return (sod >= self.start_s and self._on(day)) or (
            sod < self.end_s and self._on((day - 1) % 7)
        )

    def _on(self, day: int) -> bool:
        return not self.days or day in self.days

    def describe(self) -> str:
        days = "" if not self.days else " " + ",".join(DAYS[d] for d in sorted(self.days))
        return (
            f"scheduled minimum {self.name!r} ({_hms(self.start_s)}-{_hms(self.end_s)} UTC{days})"
        )


def parse_time(text: str) -> int:
    """``HH:MM`` or ``HH:MM:SS`` as seconds after midnight."""
    if not re.match(TIME_PATTERN, text):
        raise ScheduleError(f"not a time of day HH:MM[:SS]: {text!r}")
    parts = [int(x) for x in text.split(":")]
    return parts[0] * 3600 + parts[1] * 60 + (parts[2] if len(parts) == 3 else 0)


def _hms(s: int) -> str:
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def from_spec(
    items: Iterable[Mapping[str, Any]], roles: Iterable[str]
) -> tuple[ScheduledMinimum, ...]:
    """The CRD's list (already validated by the API server) as windows."""
    roles = tuple(roles)
    out = []
    for it in items:
        start, end = parse_time(it["start"]), parse_time(it["end"])
        if start == end:
            raise ScheduleError(f"scheduled minimum {it['name']!r}: start and end are equal")
        out.append(
            ScheduledMinimum(
                name=str(it["name"]),
                start_s=start,
                end_s=end,
                days=frozenset(DAYS.index(d) for d in it.get("days") or ()),
                minimums={r: int(it[r]) for r in roles if it.get(r) is not None},
            )
        )
    return tuple(out)


def floors(windows: Iterable[ScheduledMinimum], now: float) -> dict[str, tuple[int, str]]:
    """Per role, the highest minimum of the windows on at ``now`` and the window that sets it."""
    out: dict[str, tuple[int, str]] = {}
    for w in windows:
        if not w.active(now):
            continue
        for r, n in w.minimums.items():
            if n > out.get(r, (0, ""))[0]:
                out[r] = (n, w.describe())
    return out
