"""How engine and gateway pods stop: probes, preStop, drains and grace periods sized together."""

from __future__ import annotations

from typing import Any

from dsv4_operator.api.spec import parse
from dsv4_operator.reconcile import Facts, desired_children

from .conftest import make_cr


def _pods(**spec: Any) -> dict[str, dict[str, Any]]:
    cr = make_cr(model={"preset": "dsv4-tiny", "servedName": "tiny"}, **spec)
    out = {}
    for obj in desired_children(parse(cr), Facts(kv_token="t")):
        if obj["kind"] in ("StatefulSet", "Deployment"):
            out[obj["metadata"]["name"]] = obj["spec"]["template"]["spec"]
    return out


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_an_engine_pod_drains_for_its_grace_period_less_the_pause_and_the_exit_margin() -> None:
    pod = _pods(prefill={"terminationGracePeriodSeconds": 60})["v4-prefill-0"]
    engine, sidecar = pod["containers"]
    assert pod["terminationGracePeriodSeconds"] == 60
    assert _flag(engine["command"], "--shutdown-timeout") == "50"
    assert _flag(sidecar["command"], "--shutdown-timeout") == "50"
    for c in (engine, sidecar):
        assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    # 5 s pause + 50 s drain + 5 s to exit == the grace period: kubelet never cuts a drain
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "kv-metrics"}


def test_the_gateway_drains_as_long_as_the_longest_engine_drain() -> None:
    pods = _pods(
        prefill={"terminationGracePeriodSeconds": 30},
        decode={"terminationGracePeriodSeconds": 300},
    )
    assert _flag(pods["v4-decode-0"]["containers"][0]["command"], "--shutdown-timeout") == "290"
    gateway = pods["v4-gateway"]
    [container] = gateway["containers"]
    assert _flag(container["command"], "--shutdown-timeout") == "290"
    assert gateway["terminationGracePeriodSeconds"] == 300
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
