"""The operator's half of its contract with the engine, sidecar and gateway: engine.json holds
only EngineConfig fields the engine accepts, and every command line the operator renders parses
with the real ``dsv4`` command's parsers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsv4_operator.api.spec import DeploymentSpec, parse
from dsv4_operator.reconcile import Facts, desired_children
from dsv4_operator.reconcile.engine_config import engine_config

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "manifests" / "examples").glob("*.yaml"))


def _example(path: Path) -> DeploymentSpec:
    cr: dict[str, Any] = yaml.safe_load(path.read_text())
    cr["metadata"].update(namespace="ml", uid="u")
    return parse(cr)


def _children(spec: DeploymentSpec) -> list[dict[str, Any]]:
    return desired_children(spec, Facts(kv_token="t", lws_available=True))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_engine_json_holds_only_engine_config_fields_the_engine_accepts(path: Path) -> None:
    from dsv4_serving.engine.config import EngineConfig

    spec = _example(path)
    cm = next(o for o in _children(spec) if o["metadata"]["name"] == f"{spec.name}-engine")
    values = json.loads(cm["data"]["engine.json"])
    assert set(values) <= {f.name for f in dataclasses.fields(EngineConfig)}
    assert None not in values.values()
    config = EngineConfig.from_dict(values)
    assert config.served_model_name == spec.model.served_name
    assert config.max_model_len == spec.model.max_model_len
    assert config.kv_sidecar == "http://127.0.0.1:14580"


def test_engine_json_is_flat_and_names_the_model_source() -> None:
    spec = _example(next(p for p in EXAMPLES if p.stem == "tiny-cpu"))
    assert engine_config(spec) == {
        "model": "dsv4-tiny",
        "served_model_name": "dsv4-tiny",
        "dtype": "float32",
        "quantization": "auto",
        "max_model_len": 4096,
        "kv_sidecar": "http://127.0.0.1:14580",
        "kv_failure_policy": "recompute",
        "kv_pull_timeout": 30,
        "kv_sidecar_wait": 120,
        "kv_events_endpoint": "tcp://0.0.0.0:5557",
    }


def _commands(spec: DeploymentSpec) -> list[list[str]]:
    out = []
    for obj in _children(spec):
        if obj["kind"] in ("StatefulSet", "Deployment"):
            pod = obj["spec"]["template"]["spec"]
        elif obj["kind"] == "LeaderWorkerSet":
            pod = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
        else:
            continue
        out += [c["command"] for c in pod["containers"]]
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_rendered_command_parses_with_the_dsv4_command(path: Path) -> None:
    from dsv4_common.cli import build_parser

    parser = build_parser()
    commands = _commands(_example(path))
    assert {tuple(c[:2]) for c in commands} == {
        ("dsv4", "engine"),
        ("dsv4", "kv-sidecar"),
        ("dsv4", "gateway"),
    }
    for argv in commands:
        parser.parse_args(argv[1:])  # exits (fails the test) on an unknown or malformed flag


def test_the_crds_owned_engine_flags_are_those_the_operator_renders() -> None:
    from dsv4_common.config_cli import flag_name
    from dsv4_operator.api.spec import OWNED_ENGINE_FLAGS
    from dsv4_operator.reconcile.engine_config import ENGINE_CONFIG_FIELDS

    specs = [_example(path) for path in EXAMPLES]
    # the optional settings no example sets
    cr = yaml.safe_load(EXAMPLES[0].read_text())
    cr["metadata"].update(namespace="ml", uid="u")
    cr["spec"]["autoscaling"] = {"ttftSeconds": 1.0, "prefill": {"promptDeadlineSeconds": 0.7}}
    specs.append(parse(cr))
    cp = yaml.safe_load(EXAMPLES[0].read_text())
    cp["metadata"].update(namespace="ml", uid="u")
    cp["spec"]["prefill"].update(mtpTokens=0)
    cp["spec"]["prefill"].setdefault("parallelism", {}).update(cp=2, dp=1, ep=1)
    specs.append(parse(cp))
    rendered = set()
    for spec in specs:
        for argv in _commands(spec):
            if argv[1] == "engine":
                rendered |= {a for a in argv if a.startswith("--")}
    npu = _example(next(p for p in EXAMPLES if p.stem != "tiny-cpu"))
    assert npu.prefill.on_npu  # its command has --rank-table
    assert set(OWNED_ENGINE_FLAGS) == rendered | {flag_name(k) for k in ENGINE_CONFIG_FIELDS}


def test_the_crds_presets_are_the_engines() -> None:
    from dsv4_operator.api.spec import PRESETS
    from dsv4_serving.presets.configs import PRESETS as ENGINE_PRESETS

    assert tuple(sorted(ENGINE_PRESETS)) == PRESETS


def test_a_prompt_deadline_reaches_the_prefill_engines_only() -> None:
    from dsv4_common.cli import build_parser

    path = next(p for p in EXAMPLES if p.stem == "tiny-cpu")
    cr = yaml.safe_load(path.read_text())
    cr["metadata"].update(namespace="ml", uid="u")
    cr["spec"]["autoscaling"] = {"ttftSeconds": 1.0, "prefill": {"promptDeadlineSeconds": 0.7}}
    spec = parse(cr)
    assert spec.autoscaling.prefill.prompt_deadline_s == 0.7
    engines = [c for c in _commands(spec) if c[1] == "engine"]
    by_role = {c[c.index("--role") + 1]: c for c in engines}
    assert by_role["prefill"][by_role["prefill"].index("--prompt-deadline") + 1] == "0.7"
    assert "--prompt-deadline" not in by_role["decode"]
    args = build_parser().parse_args(by_role["prefill"][1:])
    assert args.prompt_deadline == 0.7
    # unset: first come, first served, no flag
    assert not any("--prompt-deadline" in c for c in _commands(_example(path)))
