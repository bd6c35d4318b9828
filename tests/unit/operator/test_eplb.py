"""``features.eplb`` reaches the engines: engine.json holds the EPLB fields the engine takes
(only when enabled), and the engine accepts them for each role's parallel sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from dsv4_operator.api.spec import parse
from dsv4_operator.reconcile import Facts, desired_children
from dsv4_operator.reconcile.engine_config import engine_config

EXAMPLE = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "v4-flash-ascend.yaml"


def _cr(eplb: dict[str, Any] | None) -> dict[str, Any]:
    cr: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    cr["metadata"].update(namespace="ml", uid="u")
    if eplb is not None:
        cr["spec"].setdefault("features", {})["eplb"] = eplb
    return cr


def test_enabled_eplb_renders_the_engine_flags() -> None:
    spec = parse(_cr({"enabled": True, "redundantExperts": 16, "intervalSteps": 300}))
    values = engine_config(spec)
    assert {k: v for k, v in values.items() if "eplb" in k} == {
        "enable_eplb": True,
        "eplb_redundant_experts": 16,
        "eplb_interval": 300,
        "eplb_window": 600,
    }


def test_the_engines_accept_the_rendered_eplb_settings_for_each_role() -> None:
    from dsv4_serving.engine.config import EngineConfig

    spec = parse(_cr({"enabled": True, "redundantExperts": 16, "windowSteps": 100}))
    children = desired_children(spec, Facts(kv_token="t", lws_available=True))
    cm = next(o for o in children if o["metadata"]["name"] == f"{spec.name}-engine")
    values = json.loads(cm["data"]["engine.json"])
    for role in (spec.prefill, spec.decode):
        par = role.parallelism
        sizes = {
            "tensor_parallel_size": par.tp,
            "data_parallel_size": par.dp,
            "expert_parallel_size": par.ep,
        }
        config = EngineConfig.from_dict(values | sizes)
        assert config.enable_eplb and config.eplb_redundant_experts == 16
        assert config.eplb_window == 100 and config.eplb_interval == 600


def test_eplb_off_renders_nothing_and_the_engine_keeps_its_defaults() -> None:
    for eplb in (None, {"enabled": False}):
        assert not {k for k in engine_config(parse(_cr(eplb))) if "eplb" in k}
