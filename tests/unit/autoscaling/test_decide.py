"""Table tests of one autoscaler tick: each formula and guard with exact results."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsv4_operator.autoscaling.decide import Decision, RoleState, State, decide
from dsv4_operator.autoscaling.policy import Policy, RoleBounds
from dsv4_operator.autoscaling.signals import Observations, RoleSignals

POLICY = Policy(
    ttft_s=2.0,
    tpot_s=0.05,
    bounds={"prefill": RoleBounds(1, 4), "decode": RoleBounds(1, 4)},
)
LONG_AGO = -10_000.0  # started long before: scale-down is not held by the restart guard


def obs(
    p: RoleSignals | None = None,
    d: RoleSignals | None = None,
    *,
    at: float = 0.0,
    ttft: float | None = 0.5,
    tpot: float | None = 0.02,
    requests: int = 100,
    transfer: float | None = None,
) -> Observations:
    return Observations(
        observed_at=at,
        roles={"prefill": p or RoleSignals(ready=1), "decode": d or RoleSignals(ready=1)},
        ttft_p90=ttft,
        tpot_p90=tpot,
        requests=requests,
        transfer_p90=transfer,
    )


def tick(
    o: Observations | None,
    st: State | None = None,
    now: float = 0.0,
    policy: Policy = POLICY,
    fresh: bool = True,
) -> tuple[Decision, State]:
    """One tick at ``now``; the observations are stamped ``now`` unless ``fresh`` is False."""
    if o is not None and fresh:
        o = replace(o, observed_at=now)
    return decide(o, st or State(started_at=LONG_AGO), policy, now)


def targets(dec: Decision) -> tuple[int, int]:
    return dec.roles["prefill"].target, dec.roles["decode"].target


def test_quiet_steady_state_holds() -> None:
    dec, _ = tick(obs())
    assert targets(dec) == (1, 1)
    assert dec.summary == "hold"
    assert dec.active.reason == "Active"
    assert dec.events == ()


def test_ttft_breach_blamed_on_prefill_scales_prefill_after_two_ticks() -> None:
    o = obs(RoleSignals(ready=2, waiting=1), ttft=2.5)
    dec, st = tick(o)
    assert targets(dec) == (2, 1)
    assert "short for 1 tick(s)" in dec.roles["prefill"].reason
    dec, st = tick(o, st, now=15)
    assert targets(dec) == (3, 1)
    assert dec.roles["prefill"].direction == "up"
    assert [e.reason for e in dec.events] == ["ScaledUp"]
    assert dec.events[0].message == "prefill 2->3: ttft p90 2.5s > 2s"


def test_panic_scales_up_at_once_by_half_the_ready_instances() -> None:
    policy = replace(POLICY, bounds={"prefill": RoleBounds(1, 8), "decode": RoleBounds(1, 8)})
    o = obs(RoleSignals(ready=4, waiting=40), ttft=3.0)
    dec, _ = tick(o, policy=policy)
    assert targets(dec) == (5, 1)  # want ready+1 = 5: the step limit (+2) is not the bound
    o = obs(RoleSignals(ready=4, waiting=40, prompt_tokens_per_s=8000.0), ttft=3.0)
    dec, _ = tick(o, policy=replace(policy, prefill_tokens_per_s=500.0))
    # capacity wants ceil(8000 / (0.8 * 500)) = 20 -> clamped to 8, step +2
    assert targets(dec) == (6, 1)
    assert dec.limited.status == "True" and dec.limited.reason == "AtMax"
    assert {e.reason for e in dec.events} == {"ScaledUp", "SLOAtRisk"}


def test_ttft_breach_with_decode_queue_is_blamed_on_decode() -> None:
    o = obs(RoleSignals(ready=1), RoleSignals(ready=1, waiting=3, running=4), ttft=2.5)
    _, st = tick(o)
    dec, _ = tick(o, st, now=15)
    assert targets(dec) == (1, 2)
    assert dec.roles["decode"].reason == "decode queue 3.0/instance"


def test_ttft_breach_from_kv_transfer_warns_and_scales_nothing() -> None:
    o = obs(ttft=2.5, transfer=1.0)
    _, st = tick(o)
    dec, _ = tick(o, st, now=15)
    assert targets(dec) == (1, 1)
    assert [e.reason for e in dec.events] == ["KVTransferSlow"]


def test_tpot_breach_scales_decode_from_the_batch_target() -> None:
    o = obs(d=RoleSignals(ready=2, running=40.0), tpot=0.08)
    _, st = tick(o)
    dec, _ = tick(o, st, now=15)
    # running 40 over the default batch target 16 wants 3; tpot breach wants ready+1 = 3
    assert targets(dec) == (1, 3)
    assert dec.roles["decode"].signals["batchTarget"] == 16.0


def test_kv_usage_raises_decode() -> None:
    o = obs(d=RoleSignals(ready=2, running=4.0, kv_usage=1.9))
    _, st = tick(o)
    dec, _ = tick(o, st, now=15)
    assert dec.roles["decode"].recommended == 3  # ceil(1.9 / 0.8)
    assert "KV usage" in dec.roles["decode"].reason


def test_thin_data_ignores_latency_and_says_so() -> None:
    o = obs(RoleSignals(ready=1), ttft=9.0, tpot=9.0, requests=3)
    _, st = tick(o)
    dec, _ = tick(o, st, now=15)
    assert targets(dec) == (1, 1)
    assert dec.active.reason == "InsufficientData"


@pytest.mark.parametrize("age", [31.0, 1000.0])
def test_stale_observations_hold_every_role(age: float) -> None:
    o = obs(RoleSignals(ready=3, waiting=50), RoleSignals(ready=2), at=0.0, ttft=9.0)
    st = State(started_at=LONG_AGO)
    dec, st2 = tick(o, st, now=age, fresh=False)
    assert targets(dec) == (3, 2)
    assert st2 is st
    assert dec.active.status == "False" and dec.active.reason == "MetricsUnavailable"
    assert [e.reason for e in dec.events] == ["MetricsUnavailable"]


def test_missing_observations_hold() -> None:
    dec, _ = tick(None)
    assert dec.active.reason == "MetricsUnavailable"


def test_no_second_scale_up_while_instances_are_starting() -> None:
    o = obs(RoleSignals(ready=1, starting=1, waiting=10), ttft=5.0)
    dec, st = tick(o)
    dec, _ = tick(o, st, now=15)
    assert targets(dec) == (2, 1)  # ready + 1 is on its way
    assert dec.roles["prefill"].reason == "ttft p90 5s > 2s; 1 instance(s) starting"
    policy = replace(POLICY, prefill_tokens_per_s=100.0)
    o = obs(RoleSignals(ready=1, starting=1, waiting=10, prompt_tokens_per_s=300.0), ttft=5.0)
    dec, st = tick(o, policy=policy)
    dec, _ = tick(o, st, now=15, policy=policy)
    assert dec.roles["prefill"].recommended == 4  # ceil(300 / 80)
    assert targets(dec) == (2, 1)
    assert "waiting for 1 starting instance(s)" in dec.roles["prefill"].reason


def test_unschedulable_instance_blocks_scale_up_with_an_event() -> None:
    o = obs(RoleSignals(ready=1, starting=1, blocked=1, waiting=10), ttft=5.0)
    dec, _ = tick(o)
    assert targets(dec) == (2, 1)
    assert [e.reason for e in dec.events] == ["ScaleUpBlocked"]
    assert dec.limited.reason == "ScaleUpBlocked"


def test_scale_down_one_at_a_time_once_the_window_is_quiet() -> None:
    o = obs(RoleSignals(ready=3), RoleSignals(ready=3, running=2.0), ttft=0.3, tpot=0.01)
    dec, _ = tick(o)
    assert targets(dec) == (2, 2)
    assert dec.roles["prefill"].direction == "down"
    assert dec.summary.startswith("prefill 3->2: load fits 2 instance(s); decode 3->2")


def test_no_scale_down_within_the_window_of_a_high_recommendation() -> None:
    busy = obs(RoleSignals(ready=2, waiting=8), ttft=3.0)
    _, st = tick(busy, now=0)
    quiet = obs(RoleSignals(ready=2), ttft=0.3)
    dec, st = tick(quiet, st, now=15)
    assert dec.roles["prefill"].target == 2
    assert "highest recommendation in the last 300s is 3" in dec.roles["prefill"].reason
    dec, _ = tick(quiet, st, now=301)
    assert dec.roles["prefill"].target == 1


def test_no_scale_down_for_a_window_after_start_or_after_a_scale_up() -> None:
    o = obs(RoleSignals(ready=3), ttft=0.3)
    dec, _ = tick(o, State(started_at=0.0), now=100)
    assert "started less than one stabilisation window ago" in dec.roles["prefill"].reason
    st = State(
        started_at=LONG_AGO, roles={"prefill": RoleState(), "decode": RoleState(last_up=0.0)}
    )
    dec, _ = tick(o, st, now=100)
    assert dec.roles["prefill"].reason == "not scaling down: scaled up 100s ago"


def test_consolidation_refuses_a_scale_down_that_would_breach() -> None:
    policy = replace(POLICY, prefill_tokens_per_s=1000.0)
    # 1500 tok/s on 2 instances (0.75 each) fits, on 1 instance would be 1.5 > 0.8
    o = obs(RoleSignals(ready=2, prompt_tokens_per_s=1500.0), ttft=0.3)
    dec, _ = tick(o, policy=policy)
    assert dec.roles["prefill"].recommended == 2
    assert dec.roles["prefill"].target == 2
    o = obs(RoleSignals(ready=2), RoleSignals(ready=2, running=20.0), ttft=0.3, tpot=0.01)
    dec, _ = tick(o)
    # ceil(20/16) = 2: no scale-down because of the batch target itself
    assert dec.roles["decode"].target == 2
    o = obs(RoleSignals(ready=2), RoleSignals(ready=3, running=20.0), ttft=0.3, tpot=0.045)
    dec, _ = tick(o)
    assert (
        dec.roles["decode"].reason == "not scaling down: tpot p90 45ms is not below 0.8x the target"
    )


def test_one_drain_per_role_at_a_time() -> None:
    o = obs(RoleSignals(ready=3, draining=1), ttft=0.3)
    dec, _ = tick(o)
    assert dec.roles["prefill"].reason == "not scaling down: a drain is already in progress"


def test_prefill_scale_up_raises_decode_in_the_same_tick() -> None:
    policy = replace(POLICY, prefill_tokens_per_s=1000.0)
    o = obs(
        RoleSignals(ready=1, waiting=6, prompt_tokens_per_s=1000.0),
        RoleSignals(ready=1, running=14.0),
        ttft=4.0,
    )
    dec, _ = tick(o, policy=policy)
    assert targets(dec) == (2, 2)
    # decode floor: ceil(14 / 0.02 * 0.045 / 16 * 2/1) = 4, moved at once by the +1 step
    assert dec.roles["decode"].recommended == 4
    assert dec.roles["decode"].reason == "follows prefill 1->2"


def test_no_opposite_moves_in_one_tick() -> None:
    o = obs(RoleSignals(ready=3), RoleSignals(ready=1, waiting=5, running=4.0), ttft=0.3)
    dec, _ = tick(o)
    assert targets(dec) == (3, 2)
    assert dec.roles["prefill"].reason == "not scaling down: decode scales up this tick"


def test_ratio_bounds_raise_the_smaller_role() -> None:
    policy = replace(POLICY, ratio=(0.5, 1.0))
    o = obs(RoleSignals(ready=1), RoleSignals(ready=3, running=40.0))
    dec, _ = tick(o, policy=policy)
    assert targets(dec) == (2, 3)  # 1:3 < 0.5 -> prefill raised to ceil(1.5)
    assert dec.roles["prefill"].reason == "prefill:decode ratio >= 0.5"


def test_bounds_changed_by_the_user_apply_at_once() -> None:
    policy = replace(POLICY, bounds={"prefill": RoleBounds(2, 4), "decode": RoleBounds(1, 2)})
    dec, _ = tick(obs(RoleSignals(ready=1), RoleSignals(ready=3)), policy=policy)
    assert targets(dec) == (2, 2)
    assert dec.roles["prefill"].reason == "below min 2"
    assert dec.roles["decode"].reason == "above max 2"


def test_learned_batch_target_from_itl_samples() -> None:
    # itl = 0.01 + 0.002 * running: B* = (0.9 * 0.05 - 0.01) / 0.002 = 17.5
    st = State(started_at=LONG_AGO)
    dec = None
    for i, running in enumerate((2.0, 6.0, 10.0, 14.0, 18.0)):
        o = obs(
            d=RoleSignals(ready=1, running=running, latency_p90=0.01 + 0.002 * running), tpot=None
        )
        dec, st = tick(o, st, now=15.0 * i)
    assert dec is not None
    assert dec.roles["decode"].signals["batchTarget"] == pytest.approx(17.5)


def test_the_batch_target_survives_the_window_lag_after_a_load_drop() -> None:
    """The ITL p90 covers the window, whose busiest moments set it, so each sample pairs it with
    the window's highest running count. Paired with the running count of the moment, the ten
    ticks after a drop read as (1 running, the peak's ITL) and the fit collapsed: B* fell to
    about 1 and decode stayed scaled up for minutes at low load (benchmark, 2026-12-03)."""
    policy = replace(POLICY, interval_s=1.0, window_s=10.0)
    per_instance = [1.0 + i / 10 for i in range(50)] + [1.0] * 30  # up to 5.9, then a drop
    st = State(started_at=LONG_AGO)
    targets_seen = []
    for t, _ in enumerate(per_instance):
        busiest = max(per_instance[max(0, t - 9) : t + 1])  # what the window's p90 saw
        d = RoleSignals(ready=2, running=2 * per_instance[t], latency_p90=0.02 + 0.003 * busiest)
        dec, st = tick(obs(d=d, tpot=None), st, now=float(t), policy=policy)
        targets_seen.append(dec.roles["decode"].signals["batchTarget"])
    # itl = 0.02 + 0.003 x running: B* = (0.9 x 0.05 - 0.02) / 0.003 = 8.33, before and after
    assert targets_seen[4:] == pytest.approx([25 / 3] * (len(per_instance) - 4))
    assert targets_seen[:4] == [16.0] * 4  # the default until five samples


def test_a_step_in_the_recent_prompt_rate_scales_prefill_before_the_window_shows_it() -> None:
    policy = replace(POLICY, prefill_tokens_per_s=1000.0)  # planned at 0.8 x: 800 tok/s each
    # the window's average still fits one instance; the last ticks' rate needs two
    o = obs(RoleSignals(ready=1, prompt_tokens_per_s=700.0, prompt_tokens_per_s_recent=1500.0))
    dec, st = tick(o, policy=policy)
    assert dec.roles["prefill"].recommended == 2 and targets(dec) == (1, 1)
    assert dec.roles["prefill"].reason.startswith("1500 prompt tok/s recently over 1000/instance")
    assert dec.roles["prefill"].signals["promptTokensPerSecondRecent"] == 1500.0
    dec, st = tick(o, st, now=1, policy=policy)
    assert dec.roles["prefill"].direction == "up" and targets(dec)[0] == 2
    # a recent rate below the window's does not lower the recommendation
    o = obs(RoleSignals(ready=2, prompt_tokens_per_s=1500.0, prompt_tokens_per_s_recent=100.0))
    dec, _ = tick(o, policy=policy)
    assert dec.roles["prefill"].recommended == 2
    assert dec.roles["prefill"].reason == "1500 prompt tok/s over 1000/instance"


def test_a_prefill_backlog_over_half_the_ttft_scales_prefill_and_blocks_consolidation() -> None:
    # TTFT 2 s: short when the backlog would take the instances more than 1 s
    policy = replace(POLICY, prefill_tokens_per_s=1000.0)
    o = obs(RoleSignals(ready=2, prompt_tokens_per_s=100.0, backlog_tokens=2400.0))
    dec, st = tick(o, policy=policy)
    p = dec.roles["prefill"]
    assert (p.recommended, p.target) == (3, 2)  # 1.2 s: short, not panic (1.5 s)
    assert p.reason.startswith("prefill backlog 2400 tokens, 1.20s at capacity")
    assert p.signals["backlogSeconds"] == pytest.approx(1.2)
    dec, _ = tick(o, st, now=1, policy=policy)
    assert targets(dec) == (3, 1)
    # panic: 1.5 x the limit acts in the first tick
    o = obs(RoleSignals(ready=2, prompt_tokens_per_s=100.0, backlog_tokens=3000.0))
    dec, _ = tick(o, policy=policy)
    assert targets(dec) == (3, 1)
    # under the limit nothing moves, and unknown capacity means no backlog signal
    dec, _ = tick(obs(RoleSignals(ready=2, backlog_tokens=1900.0)), policy=policy)
    assert (
        dec.roles["prefill"].recommended <= 2 and "backlogSeconds" in dec.roles["prefill"].signals
    )
    dec, _ = tick(obs(RoleSignals(ready=2, backlog_tokens=99_000.0)))
    assert "backlog" not in dec.roles["prefill"].reason
    assert "backlogSeconds" not in dec.roles["prefill"].signals
    # 1200 tokens fit two instances (0.6 s) but not one (1.2 s): no scale-down to one
    quiet = State(started_at=LONG_AGO)
    dec, _ = tick(obs(RoleSignals(ready=2, backlog_tokens=1200.0)), quiet, now=1000, policy=policy)
    assert dec.roles["prefill"].direction == "hold"
    assert dec.roles["prefill"].reason == (
        "not scaling down: the prefill backlog would take 1 instance(s) 1.20s"
    )
    dec, _ = tick(obs(RoleSignals(ready=2, backlog_tokens=900.0)), quiet, now=1000, policy=policy)
    assert dec.roles["prefill"].direction == "down"
