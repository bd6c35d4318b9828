"""The rollout planner (pure): which instances a sync replaces, keeps and removes."""

from __future__ import annotations

import pytest

from dsv4_operator.rollout.plan import RolePlan, Slot, plan_role, progress

pytestmark = pytest.mark.unit

A, B = "aaaa", "bbbb"


def _plan(
    slots: list[Slot], target: int = 2, surge: int = 1, unavailable: int = 0, **kw: object
) -> RolePlan:
    return plan_role(slots, target, B, surge, unavailable, **kw)  # type: ignore[arg-type]


def test_a_new_deployment_renders_every_instance_at_the_revision() -> None:
    assert _plan([]) == RolePlan(update=(0, 1), keep=())


def test_a_rollout_starts_with_a_surge_instance_and_keeps_every_old_one() -> None:
    old = [Slot(0, A, True), Slot(1, A, True)]
    assert _plan(old) == RolePlan(update=(2,), keep=(0, 1), surge=(2,))


def test_an_old_instance_is_replaced_once_the_surge_instance_is_ready() -> None:
    slots = [Slot(0, A, True), Slot(1, A, True), Slot(2, B, True, surge=True)]
    assert _plan(slots) == RolePlan(update=(0, 2), keep=(1,), surge=(2,))


def test_no_second_old_instance_goes_while_the_replaced_one_restarts() -> None:
    slots = [Slot(0, B, False), Slot(1, A, True), Slot(2, B, True, surge=True)]
    assert _plan(slots) == RolePlan(update=(0, 2), keep=(1,), surge=(2,))


def test_the_surge_instance_stays_until_every_instance_is_ready() -> None:
    slots = [Slot(0, B, True), Slot(1, B, False), Slot(2, B, True, surge=True)]
    assert _plan(slots) == RolePlan(update=(0, 1, 2), keep=(), surge=(2,))
    done = [Slot(0, B, True), Slot(1, B, True), Slot(2, B, True, surge=True)]
    assert _plan(done) == RolePlan(update=(0, 1), keep=())  # 2 is deleted


def test_a_plain_scale_down_deletes_at_once() -> None:
    slots = [Slot(0, B, False), Slot(1, B, True)]
    assert _plan(slots, target=1) == RolePlan(update=(0,), keep=())


def test_old_instances_are_held_until_the_new_revision_has_every_role() -> None:
    slots = [Slot(0, A, True), Slot(1, A, True), Slot(2, B, True, surge=True)]
    assert _plan(slots, hold_old=True) == RolePlan(update=(2,), keep=(0, 1), surge=(2,))


def test_an_old_instance_that_is_not_ready_is_replaced_at_once() -> None:
    slots = [Slot(0, A, True), Slot(1, A, False)]
    assert _plan(slots, hold_old=True) == RolePlan(update=(1, 2), keep=(0,), surge=(2,))


def test_max_unavailable_replaces_in_place_without_surge() -> None:
    slots = [Slot(0, A, True), Slot(1, A, True), Slot(2, A, True)]
    assert _plan(slots, target=3, surge=0, unavailable=2) == RolePlan(update=(0, 1), keep=(2,))


def test_an_instance_the_autoscaler_drains_is_left_alone() -> None:
    slots = [Slot(0, A, True), Slot(1, A, True), Slot(2, B, True, surge=True)]
    plan = _plan(slots, target=2, pinned=frozenset({1}))
    # 1 is pinned (not counted ready): 0 may go only if 2 covers it (1 instance wanted)
    assert plan == RolePlan(update=(0, 2), keep=(1,), surge=(2,))


def test_progress_counts_instances_per_revision() -> None:
    slots = [Slot(0, A, True), Slot(1, B, True), Slot(2, B, False, surge=True)]
    p = progress(slots, B)
    assert (p.updated, p.updated_ready, p.old) == (2, 1, 1)
