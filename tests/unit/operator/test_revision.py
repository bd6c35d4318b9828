"""The deployment revision: what changes it (what engine pods run) and what does not."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dsv4_operator.api.spec import parse
from dsv4_operator.reconcile import names
from dsv4_operator.reconcile.desired import Facts, desired_children
from dsv4_operator.reconcile.revision import revision

from .conftest import make_cr

pytestmark = pytest.mark.unit

BASE: dict[str, Any] = {
    "model": {"preset": "dsv4-tiny", "servedName": "tiny"},
    "prefill": {"npusPerNode": 0, "parallelism": {"tp": 1}},
    "decode": {"npusPerNode": 0, "parallelism": {"tp": 1}},
    "kvTransfer": {"transport": "tcp"},
}


def _rev(**edit: Any) -> str:
    spec = copy.deepcopy(BASE)
    for key, value in edit.items():
        spec[key] = {**spec.get(key, {}), **value}
    return revision(parse(make_cr(**spec)))


def test_what_engine_pods_run_changes_the_revision() -> None:
    base = _rev()
    assert len(base) == 10
    changed = [
        _rev(decode={"engineArgs": ["--max-num-seqs", "8"]}),
        _rev(prefill={"engineArgs": ["--max-num-seqs", "8"]}),
        _rev(engine={"image": "dsv4/engine:0.2.0"}),
        _rev(model={"maxModelLen": 2048}),  # engine.json
        _rev(decode={"mtpTokens": 0}),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_counts_gateway_and_rollout_knobs_leave_it() -> None:
    base = _rev()
    assert _rev(prefill={"instances": 3}) == base
    assert _rev(gateway={"replicas": 2}) == base
    assert _rev(decode={"rollout": {"maxSurge": 2, "maxUnavailable": 1}}) == base


def test_instances_are_labelled_and_told_their_revision_but_select_without_it() -> None:
    spec = parse(make_cr(**BASE))
    rev = revision(spec)
    sts = next(o for o in desired_children(spec, Facts(kv_token="t")) if o["kind"] == "StatefulSet")
    assert sts["metadata"]["labels"][names.REVISION_LABEL] == rev
    assert sts["spec"]["template"]["metadata"]["labels"][names.REVISION_LABEL] == rev
    assert names.REVISION_LABEL not in sts["spec"]["selector"]["matchLabels"]
    assert names.SURGE_LABEL not in sts["metadata"]["labels"]
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--revision") + 1] == rev
