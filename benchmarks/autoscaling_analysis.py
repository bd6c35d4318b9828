"""The autoscaling benchmark's analysis (``benchmarks/autoscaling.py`` runs the load): from the
load's per-request records, the operator's events and each engine's lifetime, the SLO
attainment per phase and per step up, cold starts, drains and instance-seconds. Pure but for
reading the records file."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TTFT_S, TPOT_S = 1.0, 0.05


@dataclass(frozen=True)
class Profile:
    name: str
    schedule: list[tuple[float, float]]  # (seconds, requests/s)
    input_len: int
    output_len: int
    prefill_tokens_per_s: int


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _good(r: dict[str, Any]) -> bool:
    return bool(r["ok"]) and r["ttft"] <= TTFT_S and (r["tpot"] is None or r["tpot"] <= TPOT_S)


def _instance_seconds(history: list[tuple[float, str, str]], t0: float, t1: float) -> float:
    """Seconds each engine process existed inside [t0, t1], summed."""
    alive: dict[str, float] = {}
    total = 0.0
    for t, inst, what in history:
        if what == "started":
            alive[inst] = t
        elif what == "stopped" and inst in alive:
            total += max(0.0, min(t, t1) - max(alive.pop(inst), t0))
    return total + sum(max(0.0, t1 - max(s, t0)) for s in alive.values())


def _direction_changes(events: list[tuple[float, str, str]]) -> int:
    changes = 0
    for role in ("prefill", "decode"):
        moves = [r for _, r, m in events if r in ("ScaledUp", "ScaledDown") and m.startswith(role)]
        changes += sum(1 for a, b in itertools.pairwise(moves) if a != b)
    return changes


def _cold_starts(
    t0: float, events: list[tuple[float, str, str]], history: list[tuple[float, str, str]]
) -> list[dict[str, Any]]:
    """Per instance made after the load started: its ScaledUp decision -> StatefulSet seen ->
    pod bound -> processes started -> engine Ready, in seconds after the decision. Events carry
    whole seconds (truncated), so each figure may be up to 1 s longer than the real one."""
    out = []
    for t, inst, what in history:
        if what != "created" or t < t0:
            continue
        role = "prefill" if "-prefill-" in inst else "decode"
        ups = [te for te, r, m in events if r == "ScaledUp" and m.startswith(role) and te <= t]
        if not ups:
            continue
        decision = ups[-1]
        marks = {"created": t}
        for t2, i2, w2 in history:
            if i2 == inst and t2 >= t and w2 in ("scheduled", "started", "ready"):
                marks.setdefault(w2, t2)
        out.append(
            {
                "instance": inst,
                "decision_at_s": round(decision - t0, 1),
                **{f"{k}_s": round(v - decision, 1) for k, v in marks.items()},
            }
        )
    return out


def phase_starts(p: Profile, t0: float) -> list[float]:
    """Epoch seconds each schedule phase starts at, the schedule having started at ``t0``."""
    return [t0 + sum(sec for sec, _ in p.schedule[:i]) for i in range(len(p.schedule))]


def _phases(p: Profile, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    phases = []
    for i, (sec, rate) in enumerate(p.schedule):
        mine = [r for r in records if r["phase"] == i]
        good = sum(1 for r in mine if _good(r))
        phases.append(
            {
                "seconds": sec,
                "rate": rate,
                "requests": len(mine),
                "failed": sum(1 for r in mine if not r["ok"]),
                "slo_attainment": good / len(mine) if mine else None,
            }
        )
    return phases


def _steps(
    p: Profile,
    t0: float,
    starts: list[float],
    records: list[dict[str, Any]],
    events: list[tuple[float, str, str]],
    history: list[tuple[float, str, str]],
    lead: float,
) -> list[dict[str, Any]]:
    """Per load step up: the decision, the new engine Ready and the SLO recovered, in seconds
    after the step."""
    steps = []
    for i in range(1, len(p.schedule)):
        if p.schedule[i][1] <= p.schedule[i - 1][1]:
            continue
        step = starts[i]
        up = next((t for t, r, _ in events if r == "ScaledUp" and t >= step - 1 - lead), None)
        ready = next((t for t, _, w in history if w == "ready" and up and t >= up - 1), None)
        recovered = None
        if up is not None:
            b = max(up, step)
            while b < starts[i] + p.schedule[i][0]:
                rs = [r for r in records if b <= t0 + r["start"] < b + 5]
                if rs and sum(1 for r in rs if _good(r)) / len(rs) >= 0.9:
                    recovered = b
                    break
                b += 5

        def rel(x: float | None, step: float = step) -> float | None:
            return None if x is None else round(x - step, 1)

        steps.append(
            {
                "phase": i,
                "decision_s": rel(up),
                "ready_s": rel(ready),
                "recovered_s": rel(recovered),
            }
        )
    return steps


def _drains(events: list[tuple[float, str, str]]) -> list[dict[str, Any]]:
    drains = []
    for t, r, m in events:
        if r == "DrainStarted":
            inst = m.split("instance ", 1)[1].split(":", 1)[0]
            done = next(
                (
                    (t2, r2)
                    for t2, r2, m2 in events
                    if r2 in ("DrainCompleted", "DrainTimedOut") and f" {inst} " in m2 and t2 >= t
                ),
                None,
            )
            drains.append(
                {
                    "instance": inst,
                    "seconds": None if done is None else done[0] - t,
                    "outcome": None if done is None else done[1],
                }
            )
    return drains


def analyse(
    p: Profile,
    t0: float,
    records: list[dict[str, Any]],
    events: list[tuple[float, str, str]],
    history: list[tuple[float, str, str]],
    t1: float,
    lead: float = 0.0,
) -> dict[str, Any]:
    """``lead``: a scheduled minimum raised the floor this long before each step up (the
    decision then comes before the step)."""
    starts = phase_starts(p, t0)
    phases = _phases(p, records)
    steps = _steps(p, t0, starts, records, events, history, lead)
    drains = _drains(events)
    cold = _cold_starts(t0, events, history)
    overall = sum(1 for r in records if _good(r)) / len(records) if records else None
    scaling = [(t, w) for t, _, w in history]
    busy = [
        r
        for r in records
        if any(abs(t0 + r["start"] - t) < 30 for t, w in scaling if w in ("started", "stopped"))
    ]
    inst_s = _instance_seconds(history, t0, t1)
    static_s = 4 * (t1 - t0)
    return {
        "phases": phases,
        "slo_attainment": overall,
        "steps": steps,
        "cold_starts": cold,
        "drains": drains,
        "failed": sum(1 for r in records if not r["ok"]),
        "failed_near_scaling": sum(1 for r in busy if not r["ok"]),
        "instance_seconds": inst_s,
        "static_max_instance_seconds": static_s,
        "vs_static_max": inst_s / static_s if static_s else None,
        "direction_changes_per_hour": _direction_changes(events) / max((t1 - t0) / 3600, 1e-9),
        "scale_events": [(round(t - t0, 1), r, m) for t, r, m in events if r != "SLOAtRisk"],
    }
