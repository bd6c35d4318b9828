from __future__ import annotations

import pytest

from dsv4_serving.bench.schedule import Phase, ScheduleError, arrivals, parse_schedule


def test_parse_steps_in_seconds_and_minutes() -> None:
    assert parse_schedule("60s@0.5, 2m@4,90s@0") == [Phase(60, 0.5), Phase(120, 4), Phase(90, 0)]


@pytest.mark.parametrize("bad", ["60@1", "s@1", "10s@", "10s@-1", "0s@1", "10h@1"])
def test_bad_steps_name_the_step(bad: str) -> None:
    with pytest.raises(ScheduleError, match="--schedule step"):
        parse_schedule(bad)


def test_arrivals_stay_in_their_phase_at_about_the_rate() -> None:
    phases = parse_schedule("100s@2,50s@0,100s@8")
    a = arrivals(phases, seed=1)
    assert a == sorted(a)
    counts = [sum(1 for _, p in a if p == i) for i in range(3)]
    assert counts[1] == 0
    assert 150 <= counts[0] <= 250 and 700 <= counts[2] <= 900
    assert all(0 <= t < 100 for t, p in a if p == 0)
    assert all(150 <= t < 250 for t, p in a if p == 2)
    assert arrivals(phases, seed=1) == a  # seeded: the same run twice


def test_runaway_schedules_are_refused() -> None:
    with pytest.raises(ScheduleError, match="more than 100000"):
        arrivals(parse_schedule("1000s@1000"), seed=0)
