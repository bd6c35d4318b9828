"""The operator wires KV events end to end: every engine pod publishes on the KV events port
(engine.json), the gateway is told that port, the NetworkPolicy admits the gateway (and only
it) on every DP rank's two ports, and the endpoints the gateway derives for a discovered pod
are the ones that pod's ranks bind."""

from __future__ import annotations

import json
from typing import Any

import yaml

from dsv4_common.kv_events import rank_endpoints
from dsv4_common.ports import KV_EVENTS_PORT
from dsv4_operator.api.spec import DeploymentSpec, parse
from dsv4_operator.reconcile import Facts, desired_children, names
from dsv4_operator.reconcile.gateway import gateway_command
from dsv4_operator.reconcile.network import network_policies
from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.gateway.instances import Instance
from dsv4_serving.gateway.kv_subscriber import endpoint_of
from tests.unit.operator.test_engine_contract import EXAMPLES


def _spec(dp: int = 1) -> DeploymentSpec:
    path = next(p for p in EXAMPLES if p.stem == "tiny-cpu")
    cr: dict[str, Any] = yaml.safe_load(path.read_text())
    cr["metadata"].update(namespace="ml", uid="u")
    return parse(cr) if dp == 1 else _with_dp(cr, dp)


def _with_dp(cr: dict[str, Any], dp: int) -> DeploymentSpec:
    for role in ("prefill", "decode"):
        par = cr["spec"][role].setdefault("parallelism", {})
        tp = par.get("tp", 1)
        par.update(dp=dp, tp=tp)
        cr["spec"][role]["npusPerNode"] = tp * dp
    return parse(cr)


def test_engines_publish_and_the_gateway_dials_the_same_port() -> None:
    spec = _spec()
    cm = next(
        o
        for o in desired_children(spec, Facts(kv_token="t", lws_available=True))
        if o["metadata"]["name"] == f"{spec.name}-engine"
    )
    config = EngineConfig.from_dict(json.loads(cm["data"]["engine.json"]))
    assert config.kv_events_endpoint == f"tcp://0.0.0.0:{KV_EVENTS_PORT}" == "tcp://0.0.0.0:5557"
    argv = gateway_command(spec)
    assert argv[argv.index("--kv-events-port") + 1] == "5557"
    # a discovered pod at 10.1.2.3: the gateway dials the ports its ranks bound
    pod = Instance(url="http://10.1.2.3:8000", role="decode", dp_size=2)
    endpoint = endpoint_of(pod, {}, KV_EVENTS_PORT)
    assert endpoint == "tcp://10.1.2.3:5557"
    assert [rank_endpoints(endpoint, r) for r in range(2)] == [
        ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558"),
        ("tcp://10.1.2.3:5559", "tcp://10.1.2.3:5560"),
    ]
    assert [rank_endpoints(config.kv_events_endpoint, r)[0] for r in range(2)] == [
        "tcp://0.0.0.0:5557",
        "tcp://0.0.0.0:5559",
    ]
    # an explicit --kv-events entry wins over the port
    assert endpoint_of(pod, {pod.url: "tcp://h:7000"}, KV_EVENTS_PORT) == "tcp://h:7000"
    assert endpoint_of(pod, {}, 0) is None


def _events_rules(spec: DeploymentSpec) -> list[dict[str, Any]]:
    ingress = network_policies(spec)[1]["spec"]["ingress"]
    return [r for r in ingress if any(p.get("port") == KV_EVENTS_PORT for p in r["ports"])]


def test_only_the_gateway_reaches_every_ranks_event_ports() -> None:
    for dp, last in ((1, 5558), (4, 5564)):
        spec = _spec(dp)
        (rule,) = _events_rules(spec)
        gateway = {"podSelector": {"matchLabels": names.selector_for(names.gateway_labels(spec))}}
        assert rule == {
            "from": [gateway],
            "ports": [{"protocol": "TCP", "port": 5557, "endPort": last}],
        }
