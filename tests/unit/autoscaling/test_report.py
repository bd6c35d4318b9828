from __future__ import annotations

from prometheus_client import REGISTRY

from dsv4_operator.autoscaling.decide import State, decide
from dsv4_operator.autoscaling.drain import start
from dsv4_operator.autoscaling.policy import Policy, RoleBounds
from dsv4_operator.autoscaling.report import (
    autoscaling_status,
    conditions,
    events_of,
    latency_status,
    record_metrics,
)
from dsv4_operator.autoscaling.signals import Observations, RoleSignals

POLICY = Policy(2.0, 0.05, bounds={"prefill": RoleBounds(1, 4), "decode": RoleBounds(1, 4)})


def decision():  # type: ignore[no-untyped-def]
    obs = Observations(
        observed_at=0.0,
        roles={
            "prefill": RoleSignals(ready=2, waiting=9),
            "decode": RoleSignals(ready=2, running=8),
        },
        ttft_p90=3.5,
        tpot_p90=0.0123,
        requests=50,
    )
    dec, _ = decide(obs, State(started_at=-1e4), POLICY, 0.0)
    return dec


def test_status_names_what_decided() -> None:
    dec = decision()
    drain, _ = start("v4-decode-1", "decode", 0.0, None)
    st = autoscaling_status(dec, [drain], source="Gateway", observed_at="t0", last_scale_time="t0")
    assert st["active"] is True and st["source"] == "Gateway"
    assert st["lastDecision"] == (
        "prefill 2->3: ttft p90 3.5s > 2s; decode 2->3: follows prefill 2->3"
    )
    assert st["prefill"]["target"] == 3 and st["prefill"]["signals"]["ttftP90"] == "3.5"
    assert st["decode"]["draining"] == ["v4-decode-1"]
    assert latency_status(dec) == {"ttft": "3.5s", "tpot": "12.3ms"}
    assert conditions(dec)[0] == ("AutoscalingActive", "True", "Active", "observations fresh")
    assert events_of(dec)["Normal"] == [
        ("ScaledUp", "prefill 2->3: ttft p90 3.5s > 2s"),
        ("ScaledUp", "decode 2->3: follows prefill 2->3"),
    ]


def test_metrics_per_role() -> None:
    record_metrics("ml", "v4", decision(), 1.5)
    get = REGISTRY.get_sample_value
    assert (
        get(
            "dsv4_autoscaler_desired_instances",
            {"namespace": "ml", "deployment": "v4", "role": "prefill"},
        )
        == 3
    )
    assert (
        get("dsv4_autoscaler_metrics_age_seconds", {"namespace": "ml", "deployment": "v4"}) == 1.5
    )
    assert (
        get(
            "dsv4_autoscaler_decisions_total",
            {"namespace": "ml", "deployment": "v4", "role": "prefill", "direction": "up"},
        )
        >= 1
    )
