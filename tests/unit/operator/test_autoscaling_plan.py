"""The autoscaler's integration with the sync, pure parts: spec -> Policy, counts from the
workloads, the plan a sync renders (and resumes from the status), the routing ConfigMap."""

from __future__ import annotations

import json
from typing import Any

from dsv4_operator.api.spec import parse
from dsv4_operator.autoscaling.counts import role_counts
from dsv4_operator.autoscaling.from_spec import policy_of
from dsv4_operator.autoscaling.gateway_source import RoleCounts
from dsv4_operator.autoscaling.plan import (
    PlanBook,
    ScalePlan,
    effective_spec,
    from_status,
    rendered,
    routing_configmap,
)
from dsv4_operator.autoscaling.policy import RoleBounds
from dsv4_operator.reconcile.desired import Facts, desired_children
from dsv4_operator.reconcile.status import Observed, compute_status
from tests.unit.operator.conftest import make_cr

AUTOSCALED = {
    "enabled": True,
    "intervalSeconds": 1,
    "windowSeconds": 4,
    "scaleDownStabilizationSeconds": 6,
    "drainTimeoutSeconds": 30,
    "prefill": {"min": 1, "max": 3, "tokensPerSecond": 5000},
    "decode": {"min": 2, "max": 5, "runningPerInstance": 8, "kvCacheTarget": 0.7},
    "prefillDecodeRatio": {"min": 0.5, "max": 2},
}


def _spec(**autoscaling: Any) -> Any:
    cpu = {"npusPerNode": 0, "parallelism": {"tp": 1}}
    return parse(
        make_cr(
            model={"preset": "dsv4-tiny", "servedName": "tiny"},
            prefill={**cpu, "instances": 2},
            decode={**cpu, "instances": 1},
            kvTransfer={"transport": "tcp"},
            autoscaling=autoscaling,
        )
    )


def test_spec_autoscaling_becomes_the_policy() -> None:
    p = policy_of(_spec(**AUTOSCALED).autoscaling)
    assert p.bounds == {"prefill": RoleBounds(1, 3), "decode": RoleBounds(2, 5)}
    assert (p.interval_s, p.window_s, p.stabilization_s) == (1.0, 4.0, 6.0)
    assert p.prefill_tokens_per_s == 5000.0 and p.waiting_per_instance == 2.0
    assert p.running_per_instance == 8 and p.kv_target == 0.7
    assert p.ratio == (0.5, 2.0)
    assert p.max_age_s == 30.0  # two ticks of 1 s would call every scrape hiccup stale


def test_defaults_of_the_study() -> None:
    a = _spec().autoscaling
    assert (a.enabled, a.mode, a.interval_s, a.window_s) == (False, "Builtin", 15, 60)
    assert (a.stabilization_s, a.drain_timeout_s, a.metrics.source) == (300, 120, "Gateway")
    assert a.prefill.tokens_per_second is None and a.prefill_decode_ratio is None
    assert (
        a.prefill.waiting_per_instance,
        a.decode.running_per_instance,
        a.decode.kv_cache_target,
    ) == (2.0, 16, 0.8)


def _sts(name: str, role: str, idx: int, ready: bool) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "generation": 1,
            "labels": {"serving.dsv4.io/role": role, "serving.dsv4.io/instance": str(idx)},
        },
        "spec": {"replicas": 1},
        "status": {
            "observedGeneration": 1,
            "readyReplicas": int(ready),
            "updatedReplicas": int(ready),
        },
    }


def _pod(role: str, idx: int, unschedulable_at: str | None) -> dict[str, Any]:
    conds = (
        [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "lastTransitionTime": unschedulable_at,
            }
        ]
        if unschedulable_at
        else []
    )
    return {
        "metadata": {
            "name": f"v4-{role}-{idx}-0",
            "namespace": "ml",
            "labels": {"serving.dsv4.io/role": role, "serving.dsv4.io/instance": str(idx)},
        },
        "status": {"conditions": conds},
    }


def test_counts_ready_starting_blocked_draining() -> None:
    workloads = [
        _sts("v4-prefill-0", "prefill", 0, True),
        _sts("v4-prefill-1", "prefill", 1, False),
        _sts("v4-prefill-2", "prefill", 2, False),
        _sts("v4-decode-0", "decode", 0, True),
        _sts("v4-decode-1", "decode", 1, True),
        _sts("v4-decode-2", "decode", 2, True),
    ]
    workloads[-1]["metadata"]["labels"]["serving.dsv4.io/surge"] = "true"  # a rollout's
    # 2026-01-01T00:00:00Z is 1767225600
    pods = [
        _pod("prefill", 1, "2026-01-01T00:00:00Z"),  # refused 61 s ago: blocked
        _pod("prefill", 2, "2026-01-01T00:00:30Z"),  # refused 31 s ago: still only starting
    ]
    counts = role_counts(workloads, pods, {"decode": {"v4-decode-1"}}, 1767225661.0, 60.0)
    assert counts == {
        "prefill": RoleCounts(ready=1, starting=2, draining=0, blocked=1),
        "decode": RoleCounts(ready=1, starting=0, draining=1, blocked=0),
    }


def test_a_draining_instance_stays_rendered_until_released() -> None:
    spec = _spec(**AUTOSCALED)
    plan = ScalePlan({"prefill": 1, "decode": 2}, {"prefill": ("v4-prefill-1",), "decode": ()})
    assert rendered(spec, plan, "prefill") == 2 and rendered(spec, plan, "decode") == 2
    eff = effective_spec(spec, plan)
    sts = [
        o["metadata"]["name"]
        for o in desired_children(eff, Facts("t"))
        if o["kind"] == "StatefulSet"
    ]
    assert sts == ["v4-prefill-0", "v4-prefill-1", "v4-decode-0", "v4-decode-1"]
    released = ScalePlan({"prefill": 1, "decode": 2})
    assert effective_spec(spec, released).prefill.instances == 1


def test_routing_configmap_lists_the_draining_instances() -> None:
    spec = _spec(**AUTOSCALED)
    plan = ScalePlan(
        {"prefill": 1, "decode": 2}, {"prefill": ("v4-prefill-1",), "decode": ("v4-decode-2",)}
    )
    cm = routing_configmap(spec, plan)
    assert cm["metadata"]["name"] == "v4-routing"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert json.loads(cm["data"]["routing.json"]) == {"draining": ["v4-decode-2", "v4-prefill-1"]}


def test_a_restart_resumes_targets_and_drains_from_the_status() -> None:
    spec = _spec(**AUTOSCALED)
    status = {
        "prefill": {"desired": 2, "draining": ["v4-prefill-2"]},
        "decode": {"desired": 9, "draining": ["someone-else-7"]},
        "metrics": {"ttft": "0.1s"},
    }
    plan = from_status(spec, status)
    assert plan.targets == {"prefill": 2, "decode": 5}  # clamped to max
    assert plan.draining == {"prefill": ("v4-prefill-2",), "decode": ()}
    assert plan.metrics == {"ttft": "0.1s"}
    # before any target was written: spec instances, clamped to [min, max]
    assert from_status(spec, None).targets == {"prefill": 2, "decode": 2}


def test_plan_book_renders_nothing_while_disabled() -> None:
    book = PlanBook()
    assert book.plan_for(_spec(), {"prefill": {"desired": 3}}) is None
    spec = _spec(**AUTOSCALED)
    assert book.plan_for(spec, None) == from_status(spec, None)
    mine = ScalePlan({"prefill": 3, "decode": 2})
    book.put("ml", "v4", mine)
    assert book.plan_for(spec, None) is mine


def test_status_carries_the_plan() -> None:
    spec = _spec(**AUTOSCALED)
    plan = ScalePlan(
        {"prefill": 1, "decode": 2},
        {"prefill": ("v4-prefill-1",), "decode": ()},
        autoscaling={"lastDecision": "hold"},
        metrics={"ttft": "0.2s", "tpot": "20ms"},
        conditions=(("AutoscalingActive", "True", "Active", "observations fresh"),),
    )
    obs = Observed(ready_instances={"prefill": 2, "decode": 2}, gateway_ready=1)
    st = compute_status(effective_spec(spec, plan), obs, {}, "t0", plan)
    assert st["prefill"] == {
        "desired": 1,
        "ready": 1,
        "summary": "1/1",
        "draining": ["v4-prefill-1"],
        "updated": 0,
        "old": 0,
    }
    assert st["phase"] == "Progressing"  # until the drained instance is gone
    assert st["autoscaling"] == {"lastDecision": "hold"}
    assert st["metrics"] == {"ttft": "0.2s", "tpot": "20ms"}
    types = [(c["type"], c["status"], c["reason"]) for c in st["conditions"]]
    assert types[3:-1] == [("AutoscalingActive", "True", "Active")]


def test_status_says_autoscaling_is_disabled() -> None:
    spec = _spec()
    st = compute_status(spec, Observed(), {}, "t0")
    types = [(c["type"], c["status"], c["reason"]) for c in st["conditions"]]
    assert types[3:5] == [
        ("AutoscalingActive", "False", "Disabled"),
        ("ScalingLimited", "False", "Disabled"),
    ]
    assert "autoscaling" not in st and "metrics" not in st and "draining" not in st["prefill"]


def test_only_the_replica_kopf_lets_run_is_active() -> None:
    from datetime import UTC, datetime

    from dsv4_operator.autoscaling.leader import is_active

    now = datetime(2026, 1, 1, 0, 1, 0, tzinfo=UTC)

    def peer(prio: int, seen: str) -> dict[str, Any]:
        return {"priority": prio, "lastseen": seen, "lifetime": 60}

    fresh, dead = "2026-01-01T00:00:30+00:00", "2025-12-31T23:59:59+00:00"
    assert is_active(None, 0, now)  # nothing written yet: no one competes
    assert is_active({"me": peer(0, fresh)}, 0, now)
    assert not is_active({"me": peer(0, fresh), "other": peer(100, fresh)}, 0, now)
    assert is_active({"me": peer(100, fresh), "other": peer(0, fresh)}, 100, now)
    assert is_active({"me": peer(0, fresh), "gone": peer(100, dead)}, 0, now)
    # kopf pauses every replica while two live ones share a priority
    assert not is_active({"me": peer(0, fresh), "twin": peer(0, fresh)}, 0, now)


def test_engines_admit_the_operator_only_when_autoscaled() -> None:
    from dsv4_operator.reconcile.network import OPERATOR_POD_LABELS, network_policies

    def operator_ports(spec: Any) -> list[list[int]]:
        engines = network_policies(spec)[1]["spec"]["ingress"]
        return [
            [p["port"] for p in rule["ports"]]
            for rule in engines
            if any(
                (f.get("podSelector") or {}).get("matchLabels") == OPERATOR_POD_LABELS
                for f in rule.get("from", [])
            )
        ]

    spec = _spec(**AUTOSCALED)
    assert operator_ports(spec) == [[8000, spec.kv.metrics_port]]
    assert operator_ports(_spec()) == []


def test_external_mode_follows_the_scale_objects_clamped_one_drain_at_a_time() -> None:
    from dsv4_operator.autoscaling.external import external_decision

    spec = _spec(**dict(AUTOSCALED, mode="External"))
    base = ScalePlan({"prefill": 2, "decode": 3})
    counts = {"prefill": RoleCounts(ready=2), "decode": RoleCounts(ready=3)}
    d = external_decision(spec, base, counts, {"prefill": 9, "decode": 2})
    p, dec = d.roles["prefill"], d.roles["decode"]
    assert (p.direction, p.target) == ("up", 3)  # clamped to max 3
    assert (dec.direction, dec.target) == ("down", 2)
    assert (d.limited.status, d.limited.reason) == ("True", "AtMax")
    assert [e.reason for e in d.events] == ["ScaledUp"]
    assert d.active.reason == "External"
    # below min: min; unset: hold where it is
    d = external_decision(spec, base, counts, {"prefill": None, "decode": 0})
    assert (d.roles["prefill"].direction, d.roles["prefill"].target) == ("hold", 2)
    assert (d.roles["decode"].direction, d.roles["decode"].target) == ("down", 2)
    assert d.limited.reason == "AtMin"


def test_role_scale_objects_leave_replicas_to_the_external_autoscaler() -> None:
    from dsv4_operator.autoscaling.plan import rank0_selector, role_scales

    spec = _spec(**dict(AUTOSCALED, mode="External"))
    objs = role_scales(spec)
    assert [(o["kind"], o["metadata"]["name"], o["spec"]) for o in objs] == [
        ("DeepSeekV4RoleScale", "v4-prefill", {}),
        ("DeepSeekV4RoleScale", "v4-decode", {}),
    ]
    assert rank0_selector(spec, "decode") == (
        "app.kubernetes.io/instance=v4,apps.kubernetes.io/pod-index=0,serving.dsv4.io/role=decode"
    )


def test_one_loop_per_autoscaled_deployment_started_and_stopped_by_its_events() -> None:
    import asyncio

    from dsv4_operator.autoscaling.loop import Autoscalers
    from dsv4_operator.cache import WatchCache

    on, off = make_cr(autoscaling=AUTOSCALED), make_cr()
    enqueued: list[tuple[str, str]] = []

    async def body() -> None:
        book = PlanBook()
        scalers = Autoscalers(None, WatchCache(), book, enqueued.append)  # type: ignore[arg-type]
        scalers.ensure(on)
        first = scalers._tasks[("ml", "v4")]
        scalers.ensure(on)  # every event: still the one loop
        assert scalers._tasks[("ml", "v4")] is first
        await asyncio.sleep(0.05)  # the cache has no such deployment: the loop ends by itself
        assert first.done()
        scalers.ensure(on)  # and a later event starts it again
        assert scalers._tasks[("ml", "v4")] is not first
        book.put("ml", "v4", ScalePlan({"prefill": 1, "decode": 2}))
        scalers.ensure(off)  # autoscaling turned off: no loop, no plan left to render
        assert ("ml", "v4") not in scalers._tasks and book.get("ml", "v4") is None
        await scalers.close()

    asyncio.run(asyncio.wait_for(body(), 10))
    assert enqueued == []


def test_the_gateway_watches_the_routing_configmap_its_role_may_read() -> None:
    from dsv4_operator.reconcile.gateway import gateway_command, gateway_objects

    spec = _spec(**AUTOSCALED)
    name = routing_configmap(spec, None)["metadata"]["name"]
    argv = gateway_command(spec)
    assert argv[argv.index("--routing-configmap") + 1] == name == "v4-routing"
    role = next(o for o in gateway_objects(spec) if o["kind"] == "Role")
    assert {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": [name],
        "verbs": ["get", "list", "watch"],
    } in role["rules"]
