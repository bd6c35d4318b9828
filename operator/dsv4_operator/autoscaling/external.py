"""``mode: External``: the decision an HPA or KEDA made, through each role's
``DeepSeekV4RoleScale`` ``spec.replicas``, as a ``Decision`` (pure). The operator still clamps
it to min/max and removes instances one at a time through a drain, like its own decisions."""

from __future__ import annotations

from collections.abc import Mapping

from dsv4_operator.api.spec import ROLES, DeploymentSpec, Role
from dsv4_operator.autoscaling.decide import Condition, Decision, Direction, Event, RoleDecision
from dsv4_operator.autoscaling.gateway_source import RoleCounts
from dsv4_operator.autoscaling.plan import ScalePlan


def external_decision(
    spec: DeploymentSpec,
    base: ScalePlan,
    counts: Mapping[Role, RoleCounts],
    wanted: Mapping[Role, int | None],
) -> Decision:
    """``wanted``: each role's scale ``spec.replicas`` (None while unset: hold)."""
    roles: dict[Role, RoleDecision] = {}
    events: list[Event] = []
    limits: list[tuple[str, str]] = []
    for r in ROLES:
        b = spec.autoscaling.bounds(r)
        cur = base.targets[r]
        want = wanted.get(r)
        rec = cur if want is None else want
        clamped = max(b.min, min(b.max, rec))
        if want is not None and want > b.max:
            limits.append(("AtMax", f"{r}: {want} wanted, max is {b.max}"))
        elif want is not None and want < b.min:
            limits.append(("AtMin", f"{r}: {want} wanted, min is {b.min}"))
        direction: Direction = "hold"
        target = cur
        why = "as wanted" if want is not None else "no replicas set on the scale object yet"
        if clamped > cur:
            direction, target = "up", clamped
            why = f"the external autoscaler wants {want}"
            events.append(Event("Normal", "ScaledUp", f"{r} {cur}->{clamped}: {why}"))
        elif clamped < cur:
            # one instance per tick, each through a drain
            direction, target = "down", cur - 1
            why = f"the external autoscaler wants {want}"
        c = counts[r]
        roles[r] = RoleDecision(
            c.ready + c.starting, rec, target, direction, why, {"wanted": float(rec)}
        )
    moves = [
        f"{r} {d.current}->{d.target}: {d.reason}"
        for r, d in roles.items()
        if d.direction != "hold"
    ]
    limited = (
        Condition("True", limits[0][0], limits[0][1])
        if limits
        else Condition("False", "WithinBounds", "")
    )
    active = Condition(
        "True", "External", "instance counts come from the DeepSeekV4RoleScale objects"
    )
    return Decision(roles, tuple(events), active, limited, "; ".join(moves) or "hold")
