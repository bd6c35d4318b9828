"""``spec.autoscaling`` as the core's ``Policy``: the one place the CRD's names meet the core's."""

from __future__ import annotations

from dsv4_operator.api.autoscaling_spec import AutoscalingSpec
from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.autoscaling.policy import ROLES, Policy, Role, RoleBounds
from dsv4_operator.autoscaling.schedule import from_spec as scheduled_from_spec


def npus_per_instance(spec: DeploymentSpec) -> dict[Role, int]:
    """NPUs one instance of each role holds, for ``npuBudget`` (0 on CPU)."""
    roles = {"prefill": spec.prefill, "decode": spec.decode}
    return {r: roles[r].npus_per_node * roles[r].nodes_per_instance for r in ROLES}


def policy_of(a: AutoscalingSpec, npus: dict[Role, int] | None = None) -> Policy:
    return Policy(
        ttft_s=a.ttft_seconds,
        tpot_s=a.tpot_seconds,
        bounds={r: RoleBounds(a.bounds(r).min, a.bounds(r).max) for r in ROLES},
        interval_s=float(a.interval_s),
        window_s=float(a.window_s),
        stabilization_s=float(a.stabilization_s),
        # older than two ticks (and never under the window's own span of staleness) is stale
        max_age_s=max(2.0 * a.interval_s, 30.0),
        kv_target=a.decode.kv_cache_target,
        waiting_per_instance=a.prefill.waiting_per_instance,
        running_per_instance=a.decode.running_per_instance,
        prefill_tokens_per_s=a.prefill.tokens_per_second,
        ratio=(r.min, r.max) if (r := a.prefill_decode_ratio) else None,
        npu_budget=a.npu_budget,
        npus_per_instance=npus or {"prefill": 0, "decode": 0},
        scheduled=scheduled_from_spec(a.scheduled_minimums, ROLES),
    )
