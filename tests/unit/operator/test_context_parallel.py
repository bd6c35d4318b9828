"""``parallelism.cp`` on a prefill role: ranks = tp x cp x dp (per pod on CPU, NPUs on Ascend),
rendered as ``--context-parallel-size``; the CRD's rules refuse it on decode, with MTP, DP or EP,
and refuse the engine's ``-cp`` in engineArgs."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_operator.api.spec import RoleSpec, parse, spec_schema
from dsv4_operator.reconcile.engine_pod import engine_command

from .conftest import make_cr

pytestmark = pytest.mark.unit


def _cpu_prefill(**par: Any) -> RoleSpec:
    cr = make_cr(
        model={"preset": "dsv4-tiny", "servedName": "tiny"},
        prefill={"npusPerNode": 0, "mtpTokens": 0, "parallelism": par},
        decode={"npusPerNode": 0, "parallelism": {"tp": 1}},
        kvTransfer={"transport": "tcp"},
    )
    return parse(cr).prefill


def test_cp_multiplies_the_ranks_and_renders_the_engine_flag() -> None:
    role = _cpu_prefill(tp=2, cp=2)
    assert role.parallelism.ranks == 4 and role.ranks_per_node == 4
    assert role.parallelism.ep == 1  # no EP under CP: the default follows
    cmd = engine_command(role)
    assert cmd[cmd.index("--context-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--expert-parallel-size") + 1] == "1"
    assert cmd[cmd.index("--num-speculative-tokens") + 1] == "0"


def test_cp1_renders_no_flag_and_keeps_the_ep_default() -> None:
    role = _cpu_prefill(tp=2)
    assert role.parallelism.cp == 1 and role.parallelism.ep == 2
    assert "--context-parallel-size" not in engine_command(role)


def _rules(schema: dict[str, Any]) -> list[str]:
    return [v["rule"] for v in schema.get("x-kubernetes-validations", [])]


def test_the_crd_rules_count_cp_ranks_and_refuse_what_cp_cannot_run() -> None:
    s = spec_schema()["properties"]
    prefill, decode = _rules(s["prefill"]), _rules(s["decode"])
    ranks = "self.parallelism.tp * (has(self.parallelism.cp) ? self.parallelism.cp : 1)"
    assert sum(ranks in r for r in prefill) == 2  # the NPU count and the CPU split
    assert not any("mtpTokens" in r for r in prefill)  # MTP composes with CP
    assert "!has(self.parallelism.cp) || self.parallelism.cp == 1" in decode
    par = _rules(s["prefill"]["properties"]["parallelism"])
    assert any("self.ep == 1" in r and "self.dp" not in r for r in par)  # DP composes too
    arg = s["prefill"]["properties"]["engineArgs"]["items"]
    assert "self != '-cp' && !self.startsWith('-cp=')" in _rules(arg)
