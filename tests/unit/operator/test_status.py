from __future__ import annotations

from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.reconcile.revision import revision
from dsv4_operator.reconcile.status import Observed, compute_status
from dsv4_operator.rollout.plan import Slot


def _slots(rev: str, ready: dict[str, int], total: dict[str, int]) -> dict:  # type: ignore[type-arg]
    """Live instances at ``rev``: the first ``ready[role]`` of ``total[role]`` ready."""
    return {r: tuple(Slot(i, rev, i < ready[r]) for i in range(n)) for r, n in total.items()}


def _cond(status: dict, ctype: str) -> dict:  # type: ignore[type-arg]
    return next(c for c in status["conditions"] if c["type"] == ctype)


def test_progressing_until_every_instance_is_ready(npu_spec: DeploymentSpec) -> None:
    slots = _slots(revision(npu_spec), {"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 1})
    obs = Observed(ready_instances={"prefill": 1, "decode": 1}, gateway_ready=1, slots=slots)
    st = compute_status(npu_spec, obs, {}, "t0")
    assert st["phase"] == "Progressing"
    assert st["prefill"] == {"desired": 2, "ready": 1, "summary": "1/2", "updated": 1, "old": 0}
    assert st["updated"] == "2/3" and st["revision"] == revision(npu_spec)
    assert _cond(st, "Ready")["status"] == "False"
    assert "prefill 1/2" in _cond(st, "Progressing")["message"]
    assert st["observedGeneration"] == 3


def test_ready_when_all_instances_and_gateway_are(npu_spec: DeploymentSpec) -> None:
    slots = _slots(revision(npu_spec), {"prefill": 2, "decode": 1}, {"prefill": 2, "decode": 1})
    obs = Observed(ready_instances={"prefill": 2, "decode": 1}, gateway_ready=1, slots=slots)
    st = compute_status(npu_spec, obs, {}, "t0")
    assert st["phase"] == "Ready"
    assert _cond(st, "Ready")["status"] == "True"
    assert _cond(st, "RolledOut")["status"] == "True"
    assert st["gateway"]["endpoint"] == "http://v4-gateway.ml.svc:8000"


def test_problems_make_it_degraded_with_reason(npu_spec: DeploymentSpec) -> None:
    obs = Observed(
        problems=["pod v4-prefill-0-0: 0/2 nodes are available"], problem_reason="Unschedulable"
    )
    st = compute_status(npu_spec, obs, {}, "t0")
    assert st["phase"] == "Degraded"
    deg = _cond(st, "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "Unschedulable"
    assert "0/2 nodes" in deg["message"]


def test_transition_time_kept_while_status_unchanged(npu_spec: DeploymentSpec) -> None:
    obs = Observed(ready_instances={"prefill": 0}, gateway_ready=0)
    first = compute_status(npu_spec, obs, {}, "t0")
    second = compute_status(npu_spec, obs, first, "t1")
    assert _cond(second, "Ready")["lastTransitionTime"] == "t0"
    ready = compute_status(
        npu_spec,
        Observed(ready_instances={"prefill": 2, "decode": 1}, gateway_ready=1),
        second,
        "t2",
    )
    assert _cond(ready, "Ready")["lastTransitionTime"] == "t2"


def test_a_rollout_in_progress_is_progressing_while_every_instance_serves(
    npu_spec: DeploymentSpec,
) -> None:
    rev = revision(npu_spec)
    # prefill: instance 0 at an earlier revision, 1 and the surge instance 2 at the new one
    slots = {
        "prefill": (Slot(0, "0ld", True), Slot(1, rev, True), Slot(2, rev, True, surge=True)),
        "decode": (Slot(0, rev, True),),
    }
    obs = Observed(ready_instances={"prefill": 3, "decode": 1}, gateway_ready=1, slots=slots)
    st = compute_status(npu_spec, obs, {}, "t0")
    assert st["phase"] == "Progressing"
    assert _cond(st, "Ready")["status"] == "True"  # nothing is down
    rolled = _cond(st, "RolledOut")
    assert (rolled["status"], rolled["reason"]) == ("False", "RollingUpdate")
    assert rolled["message"] == f"revision {rev}: prefill 2/2 (1 old), decode 1/1"
    assert st["prefill"]["updated"] == 2 and st["prefill"]["old"] == 1
    assert st["updated"] == "3/3"
