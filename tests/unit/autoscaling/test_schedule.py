"""Scheduled minimums: when a window is on, and what ``decide`` does with the raised floor."""

from __future__ import annotations

import calendar
from dataclasses import replace

import pytest

from dsv4_operator.autoscaling.decide import State, decide
from dsv4_operator.autoscaling.from_spec import policy_of
from dsv4_operator.autoscaling.policy import Policy, RoleBounds
from dsv4_operator.autoscaling.schedule import (
    ScheduledMinimum,
    ScheduleError,
    floors,
    from_spec,
    parse_time,
)
from dsv4_operator.autoscaling.signals import Observations, RoleSignals


def at(day: int, hms: str) -> float:
    """Epoch seconds of ``hms`` UTC on 2026-12-(7 + day): day 0 is a Monday."""
    h, m, s = (int(x) for x in hms.split(":"))
    return float(calendar.timegm((2026, 12, 7 + day, h, m, s, 0, 0, 0)))


def window(start: str, end: str, days: tuple[str, ...] = (), **mins: int) -> ScheduledMinimum:
    item = {"name": "peak", "start": start, "end": end, "days": list(days), **mins}
    (w,) = from_spec([item], ("prefill", "decode"))
    return w


def test_parse_time() -> None:
    assert parse_time("00:00") == 0
    assert parse_time("09:30") == 34_200
    assert parse_time("23:59:59") == 86_399
    for bad in ("24:00", "9:30", "09:60", "09:30:60", "noon", "09:30:00Z"):
        with pytest.raises(ScheduleError, match="HH:MM"):
            parse_time(bad)


def test_from_spec_reads_the_crd_list() -> None:
    (w,) = from_spec(
        [{"name": "eu", "start": "08:45", "end": "18:00:30", "days": ["Mon", "Fri"], "prefill": 3}],
        ("prefill", "decode"),
    )
    assert w == ScheduledMinimum("eu", 31_500, 64_830, frozenset({0, 4}), {"prefill": 3})
    assert w.describe() == "scheduled minimum 'eu' (08:45:00-18:00:30 UTC Mon,Fri)"
    with pytest.raises(ScheduleError, match="start and end are equal"):
        from_spec([{"name": "x", "start": "09:00", "end": "09:00:00", "decode": 1}], ("decode",))


def test_a_window_is_on_from_start_inclusive_to_end_exclusive() -> None:
    w = window("09:00", "17:00", prefill=2)
    assert [w.active(at(0, t)) for t in ("08:59:59", "09:00:00", "16:59:59", "17:00:00")] == [
        False,
        True,
        True,
        False,
    ]


def test_weekdays_and_a_window_past_midnight() -> None:
    w = window("22:00", "02:00", ("Fri",), decode=2)
    assert w.active(at(4, "23:00:00"))  # Friday evening
    assert w.active(at(5, "01:59:59"))  # Saturday morning: Friday's window
    assert not w.active(at(5, "02:00:00"))
    assert not w.active(at(5, "23:00:00"))  # Saturday evening: not a Friday
    assert not w.active(at(4, "01:00:00"))  # Friday morning belongs to Thursday's window
    every_day = window("22:00", "02:00", decode=2)
    assert every_day.active(at(4, "01:00:00"))


def test_floors_take_the_highest_window_on() -> None:
    ws = (
        window("09:00", "17:00", prefill=2, decode=1),
        replace(window("12:00", "13:00", prefill=4), name="lunch"),
    )
    assert floors(ws, at(0, "10:00:00")) == {
        "prefill": (2, "scheduled minimum 'peak' (09:00:00-17:00:00 UTC)"),
        "decode": (1, "scheduled minimum 'peak' (09:00:00-17:00:00 UTC)"),
    }
    assert floors(ws, at(0, "12:30:00"))["prefill"] == (
        4,
        "scheduled minimum 'lunch' (12:00:00-13:00:00 UTC)",
    )
    assert floors(ws, at(0, "18:00:00")) == {}


POLICY = Policy(
    ttft_s=1.0,
    tpot_s=0.05,
    bounds={"prefill": RoleBounds(1, 3), "decode": RoleBounds(1, 3)},
    stabilization_s=30.0,
    scheduled=(window("09:00", "09:01:30", prefill=2),),
)


def quiet(now: float, prefill: int = 1) -> Observations:
    return Observations(
        observed_at=now,
        roles={"prefill": RoleSignals(ready=prefill), "decode": RoleSignals(ready=1)},
        ttft_p90=0.3,
        tpot_p90=0.02,
        requests=100,
    )


def test_the_floor_rises_at_the_window_start_without_waiting_for_load() -> None:
    st = State(started_at=at(0, "08:00:00"))
    dec, st = decide(quiet(at(0, "08:59:59")), st, POLICY, at(0, "08:59:59"))
    assert dec.roles["prefill"].target == 1
    now = at(0, "09:00:00")
    dec, st = decide(quiet(now), st, POLICY, now)
    assert (dec.roles["prefill"].direction, dec.roles["prefill"].target) == ("up", 2)
    assert dec.roles["prefill"].reason == "scheduled minimum 'peak' (09:00:00-09:01:30 UTC)"
    assert [e.reason for e in dec.events] == ["ScaledUp"]
    assert dec.roles["decode"].target == 1  # the window names prefill only
    # with stale metrics (held sizes) the floor still applies: it needs none
    dec, _ = decide(quiet(now - 600), State(started_at=0.0), POLICY, now)
    assert (dec.roles["prefill"].direction, dec.roles["prefill"].target) == ("up", 2)
    assert dec.roles["prefill"].reason == "scheduled minimum 'peak' (09:00:00-09:01:30 UTC)"


def test_after_the_window_the_usual_stabilised_scale_down_follows() -> None:
    st = State(started_at=at(0, "08:00:00"))
    t = at(0, "09:00:00")
    dec, st = decide(quiet(t), st, POLICY, t)
    assert dec.roles["prefill"].target == 2
    moves = []
    for s in range(1, 150):  # 1 s ticks until 09:02:30, two prefill instances ready
        dec, st = decide(quiet(t + s, prefill=2), st, POLICY, t + s)
        if dec.roles["prefill"].direction != "hold":
            moves.append((s, dec.roles["prefill"].direction, dec.roles["prefill"].target))
            break
        if s == 89:  # the window's last second: the floor holds
            assert dec.roles["prefill"].reason.startswith("scheduled minimum 'peak'")
    # the window ends at +90 s; its last recommendation of 2 (+89 s) leaves the 30 s
    # stabilisation window at +119 s
    assert moves == [(119, "down", 1)]


def test_a_floor_never_exceeds_max_and_an_unnamed_role_keeps_its_min() -> None:
    policy = replace(POLICY, scheduled=(window("09:00", "10:00", prefill=5, decode=1),))
    now = at(0, "09:30:00")
    dec, _ = decide(quiet(now), State(started_at=0.0), policy, now)
    assert (dec.roles["prefill"].target, dec.roles["decode"].target) == (3, 1)


def test_policy_of_reads_the_windows_from_the_spec() -> None:
    from dsv4_operator.api.autoscaling_spec import AutoscalingSpec, DecodeScaling, PrefillScaling

    a = AutoscalingSpec(
        enabled=True,
        ttft_seconds=1.0,
        tpot_seconds=0.05,
        prefill=PrefillScaling(min=1, max=2),
        decode=DecodeScaling(min=1, max=2),
        scheduled_minimums=({"name": "peak", "start": "09:00", "end": "10:00", "decode": 2},),
    )
    assert policy_of(a).scheduled == (
        ScheduledMinimum("peak", 32_400, 36_000, frozenset(), {"decode": 2}),
    )
