"""spec.observability.tracing.otlpEndpoint: every engine (engine.json), KV sidecar and gateway
container of the deployment traces to it; unset, none has the setting."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dsv4_common.cli import build_parser
from dsv4_operator.api.spec import parse, spec_schema
from dsv4_operator.reconcile import Facts, desired_children
from dsv4_serving.engine.config import EngineConfig
from tests.unit.operator.conftest import make_cr

ENDPOINT = "http://otel-collector.observability:4318"
CPU = {
    "model": {"preset": "dsv4-tiny", "servedName": "tiny"},
    "prefill": {"npusPerNode": 0, "parallelism": {"tp": 1}},
    "decode": {"npusPerNode": 0, "parallelism": {"tp": 1}},
    "kvTransfer": {"transport": "tcp"},
}


def _render(**spec: Any) -> tuple[list[list[str]], dict[str, Any]]:
    children = desired_children(parse(make_cr(**spec)), Facts(kv_token="t"))
    commands, engine_json = [], {}
    for obj in children:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            commands += [c["command"] for c in obj["spec"]["template"]["spec"]["containers"]]
        if obj["kind"] == "ConfigMap" and "engine.json" in obj.get("data", {}):
            engine_json = json.loads(obj["data"]["engine.json"])
    return commands, engine_json


def _flag(argv: list[str]) -> str | None:
    return (
        argv[argv.index("--otlp-traces-endpoint") + 1] if "--otlp-traces-endpoint" in argv else None
    )


def test_the_endpoint_reaches_every_engine_sidecar_and_gateway() -> None:
    commands, engine_json = _render(**CPU, observability={"tracing": {"otlpEndpoint": ENDPOINT}})
    kinds = sorted(argv[1] for argv in commands)
    assert kinds == ["engine", "engine", "gateway", "kv-sidecar", "kv-sidecar"]
    for argv in commands:
        if argv[1] == "engine":
            assert _flag(argv) is None  # in engine.json, which --config names
            assert "--config" in argv
        else:
            assert _flag(argv) == ENDPOINT
        build_parser(argv[1]).parse_args(argv[1:])  # a flag the command knows
    assert engine_json["otlp_traces_endpoint"] == ENDPOINT
    assert EngineConfig.from_dict(engine_json).otlp_traces_endpoint == ENDPOINT


def test_unset_renders_no_tracing_anywhere() -> None:
    commands, engine_json = _render(**CPU)
    assert all(_flag(argv) is None for argv in commands)
    assert "otlp_traces_endpoint" not in engine_json


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("http://c:4318", True),
        ("https://c.example/otlp/v1/traces", True),
        ("c:4318", False),
        ("grpc://c:4317", False),
        ("http://c 4318", False),
    ],
)
def test_the_schema_pattern(value: str, ok: bool) -> None:
    import re

    pattern = spec_schema()["properties"]["observability"]["properties"]["tracing"]["properties"][
        "otlpEndpoint"
    ]["pattern"]
    assert bool(re.match(pattern, value)) is ok
