"""Status from observations: per-role ready/desired, phase, conditions (Ready, Progressing, Degraded)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from dsv4_operator.api.spec import ROLES, DeploymentSpec, Role
from dsv4_operator.autoscaling.plan import ScalePlan, status_conditions
from dsv4_operator.reconcile import names


@dataclass(frozen=True)
class Observed:
    ready_instances: dict[Role, int] = field(default_factory=dict)
    """Instances whose workload reports every pod ready (and up to date)."""
    gateway_ready: int = 0
    problems: list[str] = field(default_factory=list)
    """Why the deployment cannot make progress (unschedulable pods, crash loops, bad spec)."""
    problem_reason: str = ""
    """CamelCase reason for the first problem, e.g. Unschedulable."""

    def with_problems(self, problems: list[str], reason: str) -> Observed:
        """These problems first (they explain the others), under their reason."""
        if not problems:
            return self
        return replace(self, problems=[*problems, *self.problems], problem_reason=reason)


def _condition(
    ctype: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    previous: dict[str, Any],
    now: str,
) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = previous.get(ctype) or {}
    changed = old.get("status") != status
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": now
        if changed or not old.get("lastTransitionTime")
        else old["lastTransitionTime"],
    }


def compute_status(
    spec: DeploymentSpec,
    observed: Observed,
    previous: dict[str, Any],
    now: str,
    plan: ScalePlan | None = None,
) -> dict[str, Any]:
    """The status subresource; ``previous`` keeps lastTransitionTime of unchanged conditions.
    ``plan``: the autoscaler's (None when autoscaling is off): its targets are the desired
    counts (what a restarted operator resumes from), its drains and report are written along."""
    prev_conditions = {c["type"]: c for c in previous.get("conditions") or []}
    status: dict[str, Any] = {"observedGeneration": spec.generation}
    all_ready = True
    for r in ROLES:
        desired = plan.targets[r] if plan is not None else spec.role(r).instances
        ready = min(observed.ready_instances.get(r, 0), desired)
        status[r] = {"desired": desired, "ready": ready, "summary": f"{ready}/{desired}"}
        if plan is not None:
            status[r]["draining"] = list(plan.draining[r])
            # a draining instance is on its way out: the role is not done until it is gone
            all_ready &= not plan.draining[r]
        all_ready &= ready == desired
    gw_desired = spec.gateway.replicas
    gw_ready = min(observed.gateway_ready, gw_desired)
    all_ready &= gw_ready == gw_desired
    status["gateway"] = {
        "ready": gw_ready,
        "endpoint": f"http://{names.gateway_name(spec)}.{spec.namespace}.svc:{spec.gateway.port}",
    }

    degraded = bool(observed.problems)
    message = "; ".join(observed.problems[:5])
    if degraded:
        phase = "Degraded"
    elif all_ready:
        phase = "Ready"
    else:
        phase = "Progressing"
    status["phase"] = phase
    g = spec.generation
    waiting = ", ".join(
        f"{r} {status[r]['summary']}" for r in ROLES if status[r]["ready"] < status[r]["desired"]
    )
    if gw_ready < gw_desired:
        waiting = ", ".join(filter(None, [waiting, f"gateway {gw_ready}/{gw_desired}"]))
    status["conditions"] = [
        _condition(
            "Ready",
            all_ready and not degraded,
            "Degraded" if degraded else ("AllInstancesReady" if all_ready else "InstancesNotReady"),
            message
            if degraded
            else (
                "every instance and the gateway are ready"
                if all_ready
                else f"waiting for {waiting}"
            ),
            g,
            prev_conditions,
            now,
        ),
        _condition(
            "Progressing",
            not all_ready and not degraded,
            "Reconciling" if not all_ready else "Complete",
            f"waiting for {waiting}" if not all_ready else "nothing left to do",
            g,
            prev_conditions,
            now,
        ),
        _condition(
            "Degraded",
            degraded,
            observed.problem_reason or ("Problem" if degraded else "AsExpected"),
            message,
            g,
            prev_conditions,
            now,
        ),
        *(
            _condition(t, st == "True", reason, msg, g, prev_conditions, now)
            for t, st, reason, msg in status_conditions(plan)
        ),
    ]
    if plan is not None:
        if plan.autoscaling is not None:
            status["autoscaling"] = plan.autoscaling
        if plan.metrics:
            status["metrics"] = plan.metrics
    return status
