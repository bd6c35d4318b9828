"""benchmarks/ttft_stages.py: one PD request's trace cut into consecutive stages, exactly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dsv4_serving.traces.waterfall import Span

pytestmark = pytest.mark.unit

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_ttft_stages", BENCHMARKS / "ttft_stages.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


T = _load()
GW, PRE, DEC = "dsv4-gateway", "dsv4-engine-prefill", "dsv4-engine-decode"


def span(
    i: int, parent: int | None, service: str, name: str, start_ms: float, end_ms: float, **a: object
) -> Span:
    parent_id = None if parent is None else str(parent)
    start, length = int(start_ms * 1000), int((end_ms - start_ms) * 1000)
    return Span(str(i), parent_id, service, name, start, length, dict(a))


def trace(pull: bool = True) -> list[Span]:
    out = [
        span(1, None, GW, "chat dsv4-tiny", 0, 900),
        span(2, 1, GW, "dsv4.gateway.prefill", 2, 300),
        span(3, 2, PRE, "chat dsv4-tiny", 3, 299),
        span(4, 3, PRE, "dsv4.engine.queue", 3, 10),
        span(6, 3, PRE, "dsv4.engine.prefill_chunk", 50, 150, **{"dsv4.chunk.tokens": 64}),
        span(7, 3, PRE, "dsv4.engine.prefill_chunk", 160, 250, **{"dsv4.chunk.tokens": 8}),
        span(8, 3, PRE, "dsv4.kv.export", 250, 280),
        span(9, 1, GW, "dsv4.gateway.decode", 305, 900),
        span(10, 9, DEC, "chat dsv4-tiny", 306, 900),
        span(11, 10, DEC, "dsv4.engine.queue", 306, 310),
        span(12, 10, DEC, "dsv4.kv.pull", 310, 330),
        span(13, 10, DEC, "dsv4.engine.prefill_chunk", 335, 360, **{"dsv4.chunk.tokens": 1}),
        span(14, 10, DEC, "dsv4.engine.decode", 360, 900),
    ]
    if pull:
        out.append(span(5, 3, PRE, "dsv4.kv.pull", 10, 40))
    return out


def test_the_stages_cut_the_ttft_at_its_milestones() -> None:
    got = T.stages(trace())
    assert got == {
        "route": 2.0,
        "prefill_queue": 8.0,  # the attempt's start to parked for the pull
        "prefix_pull": 30.0,
        "prefill_wait": 10.0,
        "prefill": 200.0,
        "export": 50.0,
        "handoff": 5.0,
        "decode_kv": 25.0,
        "first_step": 30.0,
        "ttft": 360.0,
        "prefill_tokens": 72.0,
    }
    assert sum(got[k] for k in T.STAGES) == got["ttft"]


def test_without_a_pull_its_stage_is_zero_and_the_queue_ends_at_admission() -> None:
    got = T.stages(trace(pull=False))
    assert got is not None
    assert (got["prefill_queue"], got["prefix_pull"], got["prefill_wait"]) == (8.0, 0.0, 40.0)


def test_incomplete_or_retried_requests_are_left_out() -> None:
    assert T.stages(trace()[:9]) is None  # no decode engine spans yet
    retried = [*trace(), span(20, 1, GW, "dsv4.gateway.prefill", 1, 2)]
    assert T.stages(retried) is None


def test_the_mean_is_per_stage() -> None:
    a, b = T.stages(trace()), T.stages(trace(pull=False))
    assert a is not None and b is not None
    mean = T.mean_stages([a, b])
    assert mean is not None
    assert mean["prefix_pull"] == 15.0 and mean["ttft"] == 360.0
    assert T.mean_stages([]) is None
