"""``npuBudget``: scale-ups past the budget are granted in proportion to each role's deficit,
what exists is never taken away, and the limit is said (ScalingLimited/BudgetExhausted)."""

from __future__ import annotations

from dataclasses import replace

from dsv4_operator.autoscaling.decide import State, decide
from dsv4_operator.autoscaling.policy import Policy, RoleBounds
from dsv4_operator.autoscaling.signals import Observations, RoleSignals

POLICY = Policy(
    ttft_s=2.0,
    tpot_s=0.05,
    bounds={"prefill": RoleBounds(1, 32), "decode": RoleBounds(1, 32)},
    prefill_tokens_per_s=1000.0,
    npus_per_instance={"prefill": 8, "decode": 8},
)
# both roles short, in a panic: 4 -> 6 each (+50% a tick) without a budget
SHORT = Observations(
    observed_at=0.0,
    roles={
        "prefill": RoleSignals(ready=4, waiting=40, prompt_tokens_per_s=8000),
        "decode": RoleSignals(ready=4, waiting=10, running=128),
    },
    ttft_p90=3.0,
    tpot_p90=0.02,
    requests=100,
)


def _targets(policy: Policy, obs: Observations = SHORT) -> tuple[tuple[int, int], str]:
    dec, _ = decide(obs, State(started_at=-10_000.0), policy, 0.0)
    return (dec.roles["prefill"].target, dec.roles["decode"].target), dec.limited.reason


def test_without_a_budget_or_within_it_nothing_changes() -> None:
    assert _targets(POLICY) == ((6, 6), "WithinBounds")
    assert _targets(replace(POLICY, npu_budget=96)) == ((6, 6), "WithinBounds")


def test_equal_deficits_share_what_is_left() -> None:
    # 64 NPUs held, 16 left: one instance each
    assert _targets(replace(POLICY, npu_budget=80)) == ((5, 5), "BudgetExhausted")
    # 8 left: one instance, to the first role of equal share
    assert _targets(replace(POLICY, npu_budget=72)) == ((5, 4), "BudgetExhausted")
    # nothing left: both hold, none taken away
    assert _targets(replace(POLICY, npu_budget=10)) == ((4, 4), "BudgetExhausted")


def test_grants_follow_the_share_of_each_deficit_still_open() -> None:
    costly_decode = replace(POLICY, npus_per_instance={"prefill": 4, "decode": 16}, npu_budget=100)
    # held 4x4 + 4x16 = 80; 20 left: prefill first (shares equal), then decode (its whole
    # increase still open against half of prefill's)
    assert _targets(costly_decode) == ((5, 5), "BudgetExhausted")
    dec, _ = decide(SHORT, State(started_at=-10_000.0), costly_decode, 0.0)
    assert dec.roles["prefill"].direction == "up"
    assert "npuBudget 100: prefill gets 5 of 6 instance(s) (4 NPU(s) each)" in (
        dec.roles["prefill"].reason
    )
    assert [e.message.split(":")[0] for e in dec.events if e.reason == "ScaledUp"] == [
        "prefill 4->5",
        "decode 4->5",
    ]


def test_cpu_instances_hold_no_npus() -> None:
    cpu = replace(POLICY, npus_per_instance={"prefill": 0, "decode": 0}, npu_budget=1)
    assert _targets(cpu) == ((6, 6), "WithinBounds")


def test_the_crd_field_reaches_the_policy_with_each_role_s_npus() -> None:
    from dsv4_operator.api.spec import parse
    from dsv4_operator.autoscaling.from_spec import npus_per_instance, policy_of
    from tests.unit.operator.conftest import make_cr

    spec = parse(
        make_cr(
            prefill={"npusPerNode": 8, "nodesPerInstance": 2, "parallelism": {"tp": 16}},
            decode={"npusPerNode": 4, "parallelism": {"tp": 4}},
            autoscaling={"enabled": True, "npuBudget": 64},
        )
    )
    p = policy_of(spec.autoscaling, npus_per_instance(spec))
    assert p.npu_budget == 64
    assert p.npus_per_instance == {"prefill": 16, "decode": 4}
    unset = parse(make_cr(autoscaling={"enabled": True}))
    assert policy_of(unset.autoscaling, npus_per_instance(unset)).npu_budget is None


def test_npus_of_a_draining_instance_are_not_granted_until_it_is_gone() -> None:
    """Decode holds a fifth instance that is still draining: its 8 NPUs are not free yet, so
    prefill's increase gets only what nobody holds."""
    draining = replace(
        SHORT, roles={**SHORT.roles, "decode": replace(SHORT.roles["decode"], draining=1)}
    )
    # held 4x8 + (4 + 1 draining)x8 = 72 of 80: one instance's worth left
    assert _targets(replace(POLICY, npu_budget=80), draining) == ((5, 4), "BudgetExhausted")
    assert _targets(replace(POLICY, npu_budget=80)) == ((5, 5), "BudgetExhausted")
