"""Trace replays (step, ramp, burst, sine) through ``decide`` against a fluid plant: the
stability properties the issue names, checked on every tick of every trace."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest

from dsv4_operator.autoscaling.policy import ROLES, Policy, Role, RoleBounds
from tests.unit.autoscaling.plant import Plant, Tick, replay

POLICY = Policy(
    ttft_s=1.0,
    tpot_s=0.05,
    bounds={"prefill": RoleBounds(1, 4), "decode": RoleBounds(1, 4)},
)
LOW, HIGH = 0.5, 3.0


def step(t: float) -> float:
    return HIGH if 300 <= t < 900 else LOW


def ramp(t: float) -> float:
    return LOW + (HIGH - LOW) * min(1.0, max(0.0, (t - 300) / 600)) * (t < 1200)


def burst(t: float) -> float:
    return 6.0 if 600 <= t < 630 else LOW


def sine(t: float) -> float:
    return LOW + (HIGH - LOW) * 0.5 * (1 - math.cos(2 * math.pi * t / 1200))


TRACES: dict[str, Callable[[float], float]] = {
    "step": step,
    "ramp": ramp,
    "burst": burst,
    "sine": sine,
}


def breached(tick: Tick) -> bool:
    o = tick.obs
    return (o.ttft_p90 or 0) > POLICY.ttft_s or (o.tpot_p90 or 0) > POLICY.tpot_s


def moves(ticks: list[Tick], role: Role) -> list[tuple[float, str]]:
    return [
        (t.now, t.decision.roles[role].direction)
        for t in ticks
        if t.decision.roles[role].direction != "hold"
    ]


@pytest.fixture(params=sorted(TRACES))
def trace(request: pytest.FixtureRequest) -> tuple[str, list[Tick]]:
    name = request.param
    return name, replay(Plant(), POLICY, TRACES[name], 2400.0)


def test_counts_stay_within_bounds(trace: tuple[str, list[Tick]]) -> None:
    _, ticks = trace
    for t in ticks:
        for r in ROLES:
            b = POLICY.bounds[r]
            assert b.min <= t.decision.roles[r].target <= b.max


def test_no_scale_down_within_the_window_after_a_breach(trace: tuple[str, list[Tick]]) -> None:
    _, ticks = trace
    last_breach = -math.inf
    for t in ticks:
        if breached(t):
            last_breach = t.now
        for r in ROLES:
            if t.decision.roles[r].direction == "down":
                assert t.now - last_breach >= POLICY.stabilization_s, (r, t.now, last_breach)


def test_at_most_one_direction_change_per_window(trace: tuple[str, list[Tick]]) -> None:
    _, ticks = trace
    for r in ROLES:
        seq = moves(ticks, r)
        changes = [seq[i][0] for i in range(1, len(seq)) if seq[i][1] != seq[i - 1][1]]
        for a, b in itertools.pairwise(changes):
            assert b - a >= POLICY.stabilization_s, (r, changes)


def test_no_scale_up_while_instances_are_starting(trace: tuple[str, list[Tick]]) -> None:
    _, ticks = trace
    for t in ticks:
        for r in ROLES:
            if t.obs.roles[r].starting:
                assert t.decision.roles[r].direction != "up", (r, t.now)


def test_every_trace_returns_to_the_minimum_once_load_is_low(
    trace: tuple[str, list[Tick]],
) -> None:
    name, ticks = trace
    if name == "sine":
        return  # still oscillating at the end
    final = ticks[-1].decision.roles
    assert (final["prefill"].target, final["decode"].target) == (1, 1), name


def test_step_scales_up_within_two_ticks_of_a_sustained_breach() -> None:
    ticks = replay(Plant(), POLICY, step, 2400.0)
    onset = next(i for i, t in enumerate(ticks) if breached(t))
    first_up = next(i for i, t in enumerate(ticks) if t.decision.roles["prefill"].direction == "up")
    assert onset <= first_up <= onset + 1
    peak = max(t.decision.roles["prefill"].target for t in ticks)
    assert peak >= 2
    # the SLO is met again while the load is still high
    recovered = [t for t in ticks if 600 <= t.now < 900 and not breached(t)]
    assert recovered


def test_burst_shorter_than_a_cold_start_does_not_flap() -> None:
    ticks = replay(Plant(), POLICY, burst, 2400.0)
    seq = moves(ticks, "prefill")
    assert len(seq) <= 2 * POLICY.bounds["prefill"].max  # up then down, each at most 3 steps
    ups = [t for t, d in seq if d == "up"]
    downs = [t for t, d in seq if d == "down"]
    assert not ups or not downs or min(downs) - max(ups) >= POLICY.stabilization_s


def test_decode_heavy_step_scales_decode_not_prefill() -> None:
    plant = Plant(isl=50.0, osl=800.0)
    ticks = replay(plant, POLICY, step, 2400.0)
    peaks = {r: max(t.decision.roles[r].target for t in ticks) for r in ROLES}
    assert peaks["decode"] >= 2
    assert peaks["prefill"] == 1
