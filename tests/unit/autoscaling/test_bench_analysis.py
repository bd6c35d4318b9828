"""The autoscaling benchmark's arithmetic (``benchmarks/autoscaling_analysis.py``, beside the
script, loaded by path): cold starts per scale-up, whole-run and per-phase attainment, instance-seconds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "autoscaling_analysis.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_autoscaling", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


T0 = 1000.0
EVENTS = [
    (1012.0, "ScaledUp", "decode 1->2: 9 running, batch target 8.3"),
    (1013.0, "ScaledUp", "prefill 1->2: prefill queue 3.0/instance > 2"),
    (1040.0, "DrainStarted", "decode instance bench-decode-1: no new requests (1 in flight)"),
    (1042.0, "DrainCompleted", "decode instance bench-decode-1 idle after 2s"),
    (1042.0, "ScaledDown", "decode 2->1: bench-decode-1 removed"),
]
HISTORY = [
    # made before the load: not a scale-up's cold start
    (990.0, "bench-decode-0", "created"),
    (990.2, "bench-decode-0", "scheduled"),
    (990.3, "bench-decode-0", "started"),
    (998.0, "bench-decode-0", "ready"),
    (1012.4, "bench-decode-1", "created"),
    (1012.9, "bench-decode-1", "scheduled"),
    (1013.0, "bench-decode-1", "started"),
    (1021.5, "bench-decode-1", "ready"),
    (1013.5, "bench-prefill-1", "created"),  # never bound: only "created"
    (1043.0, "bench-decode-1", "stopped"),
]


def _rec(start: float, phase: int, ok: bool = True, ttft: float = 0.1) -> dict[str, Any]:
    return {"ok": ok, "ttft": ttft, "tpot": 0.02, "phase": phase, "start": start}


def test_cold_starts_are_timed_from_the_role_s_last_scaled_up(bench: ModuleType) -> None:
    cold = bench._cold_starts(T0, EVENTS, HISTORY)
    assert cold == [
        {
            "instance": "bench-decode-1",
            "decision_at_s": 12.0,
            "created_s": 0.4,
            "scheduled_s": 0.9,
            "started_s": 1.0,
            "ready_s": 9.5,
        },
        {"instance": "bench-prefill-1", "decision_at_s": 13.0, "created_s": 0.5},
    ]


def test_attainment_per_phase_and_whole_run_and_instance_seconds(bench: ModuleType) -> None:
    p = bench.Profile("decode-heavy", [(10, 0.3), (20, 2), (20, 0.3)], 16, 128, 4500)
    records = [_rec(1, 0), _rec(12, 1), _rec(13, 1, ttft=5.0), _rec(14, 1, ok=False), _rec(40, 2)]
    out = bench.analyse(p, T0, records, EVENTS, HISTORY, 1050.0)
    assert [ph["slo_attainment"] for ph in out["phases"]] == [1.0, 1 / 3, 1.0]
    assert out["slo_attainment"] == 3 / 5
    assert out["failed"] == 1
    # decode-0 the whole 50 s, decode-1 from 1013.0 to 1043.0
    assert out["instance_seconds"] == pytest.approx(50 + 30)
    assert out["static_max_instance_seconds"] == 200
    assert [c["instance"] for c in out["cold_starts"]] == ["bench-decode-1", "bench-prefill-1"]
