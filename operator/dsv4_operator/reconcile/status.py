"""Status from observations: per-role ready/desired, phase, conditions (Ready, Progressing, Degraded)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from dsv4_operator.api.spec import ROLES, DeploymentSpec, Role
from dsv4_operator.autoscaling.plan import ConditionTuple, ScalePlan, status_conditions
from dsv4_operator.reconcile import names
from dsv4_operator.reconcile.revision import revision
from dsv4_operator.rollout.plan import Slot, progress


@dataclass(frozen=True)
class Observed:
    ready_instances: dict[Role, int] = field(default_factory=dict)
    """Instances whose workload reports every pod ready (and up to date)."""
    gateway_ready: int = 0
    problems: list[str] = field(default_factory=list)
    """Why the deployment cannot make progress (unschedulable pods, crash loops, bad spec)."""
    problem_reason: str = ""
    """CamelCase reason for the first problem, e.g. Unschedulable."""
    slots: dict[Role, tuple[Slot, ...]] = field(default_factory=dict)
    """The live instances per role with their revision (StatefulSet mode)."""

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
    status: dict[str, Any] = {"observedGeneration": spec.generation}
    all_ready = True
    for r in ROLES:
        status[r] = _role_status(spec, r, observed, plan)
        # a draining instance is on its way out: the role is not done until it is gone
        all_ready &= status[r]["ready"] == status[r]["desired"] and not status[r].get("draining")
    rolled_out, rollout_msg = _rollout(spec, observed, status)
    gw_desired = spec.gateway.replicas
    gw_ready = min(observed.gateway_ready, gw_desired)
    all_ready &= gw_ready == gw_desired
    status["gateway"] = {
        "ready": gw_ready,
        "endpoint": f"http://{names.gateway_name(spec)}.{spec.namespace}.svc:{spec.gateway.port}",
    }
    degraded = bool(observed.problems)
    status["phase"] = (
        "Degraded" if degraded else ("Ready" if all_ready and rolled_out else "Progressing")
    )
    waiting = ", ".join(
        f"{r} {status[r]['summary']}" for r in ROLES if status[r]["ready"] < status[r]["desired"]
    )
    if gw_ready < gw_desired:
        waiting = ", ".join(filter(None, [waiting, f"gateway {gw_ready}/{gw_desired}"]))
    prev_conditions = {c["type"]: c for c in previous.get("conditions") or []}
    status["conditions"] = [
        _condition(t, st == "True", reason, msg, spec.generation, prev_conditions, now)
        for t, st, reason, msg in (
            *_own_conditions(observed, all_ready, waiting),
            *status_conditions(plan),
            (
                "RolledOut",
                _flag(rolled_out),
                "RolledOut" if rolled_out else "RollingUpdate",
                rollout_msg,
            ),
        )
    ]
    if plan is not None:
        if plan.autoscaling is not None:
            status["autoscaling"] = plan.autoscaling
        if plan.metrics:
            status["metrics"] = plan.metrics
    return status


def _rollout(spec: DeploymentSpec, observed: Observed, status: dict[str, Any]) -> tuple[bool, str]:
    """Rollout progress into ``status`` (revision, per role ``updated``/``old``, ``updated``
    over all roles): whether every instance runs the spec's revision and is ready, and why."""
    rev = revision(spec)
    status["revision"] = rev
    if spec.scheduling.use_lws:  # the LeaderWorkerSet rolls its groups itself
        return True, "LeaderWorkerSet: rolled by its own rolling update"
    done, total, ok, parts = 0, 0, True, []
    for r in ROLES:
        p = progress(observed.slots.get(r, ()), rev)
        desired = status[r]["desired"]
        updated = min(p.updated_ready, desired)
        status[r]["updated"], status[r]["old"] = updated, p.old
        done, total = done + updated, total + desired
        parts.append(f"{r} {updated}/{desired}" + (f" ({p.old} old)" if p.old else ""))
        # surge instances still there (p.updated > desired): not cleaned up yet
        ok &= not p.old and updated == desired and p.updated <= desired
    status["updated"] = f"{done}/{total}"
    return ok, f"revision {rev}: " + ", ".join(parts)


def _role_status(
    spec: DeploymentSpec, r: Role, observed: Observed, plan: ScalePlan | None
) -> dict[str, Any]:
    desired = plan.targets[r] if plan is not None else spec.role(r).instances
    ready = min(observed.ready_instances.get(r, 0), desired)
    out: dict[str, Any] = {"desired": desired, "ready": ready, "summary": f"{ready}/{desired}"}
    if plan is not None:
        out["draining"] = list(plan.draining[r])
    return out


def _own_conditions(observed: Observed, all_ready: bool, waiting: str) -> list[ConditionTuple]:
    """Ready, Progressing and Degraded as (type, status, reason, message)."""
    degraded = bool(observed.problems)
    message = "; ".join(observed.problems[:5])
    if degraded:
        ready = ("Degraded", message)
    elif all_ready:
        ready = ("AllInstancesReady", "every instance and the gateway are ready")
    else:
        ready = ("InstancesNotReady", f"waiting for {waiting}")
    return [
        ("Ready", _flag(all_ready and not degraded), *ready),
        (
            "Progressing",
            _flag(not all_ready and not degraded),
            "Reconciling" if not all_ready else "Complete",
            f"waiting for {waiting}" if not all_ready else "nothing left to do",
        ),
        (
            "Degraded",
            _flag(degraded),
            observed.problem_reason or ("Problem" if degraded else "AsExpected"),
            message,
        ),
    ]


def _flag(ok: bool) -> str:
    return "True" if ok else "False"
