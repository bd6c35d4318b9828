"""The gateway source: real prometheus_client exposition in, one tick's observations out."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from dsv4_operator.autoscaling.gateway_source import (
    ITL,
    TTFT,
    EngineLoad,
    GatewayWindow,
    RoleCounts,
    Snapshot,
    parse_histograms,
    parse_instances,
)
from dsv4_operator.autoscaling.histogram import quantile

BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0)
COUNTS = {"prefill": RoleCounts(ready=2, starting=1), "decode": RoleCounts(ready=1)}


class FakeGateway:
    """The gateway's two histograms, exported by the real client library."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(TTFT, "", registry=self.registry, buckets=BUCKETS)
        self.itl = Histogram(ITL, "", registry=self.registry, buckets=BUCKETS)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def instances(prompt: float, cached: float, running: float = 3.0) -> list[dict[str, object]]:
    return [
        {
            "url": "http://p0",
            "role": "prefill",
            "healthy": True,
            "ranks": [
                {
                    "waiting": 1.0,
                    "running": 0.0,
                    "kv_usage": 0.2,
                    "prompt_tokens": prompt,
                    "cached_tokens": cached,
                },
                {
                    "waiting": 2.0,
                    "running": 0.0,
                    "kv_usage": 0.4,
                    "prompt_tokens": 0.0,
                    "cached_tokens": 0.0,
                },
            ],
        },
        {
            "url": "http://d0",
            "role": "decode",
            "healthy": True,
            # 2 waiting, both parked for their KV: no decode queue
            "ranks": [{"waiting": 2.0, "waiting_for_kv": 2.0, "running": running, "kv_usage": 0.5}],
        },
        {"url": "http://d1", "role": "decode", "healthy": False, "ranks": [{"running": 9.0}]},
    ]


def test_parse_histograms_reads_cumulative_buckets() -> None:
    gw = FakeGateway()
    for v in (0.05, 0.3, 0.3, 2.0):
        gw.ttft.observe(v)
    h = parse_histograms(gw.text())
    assert h[TTFT] == {0.1: 1.0, 0.5: 3.0, 1.0: 3.0, 2.5: 4.0, 5.0: 4.0, math.inf: 4.0}
    assert h[ITL][math.inf] == 0.0


def test_parse_instances_sums_ranks_and_averages_kv() -> None:
    loads = parse_instances(instances(100.0, 10.0))
    p0 = loads[0]
    assert (p0.waiting, p0.running, p0.prompt_tokens, p0.cached_tokens) == (3.0, 0.0, 100.0, 10.0)
    assert (loads[1].waiting, loads[1].waiting_for_kv) == (2.0, 2.0)
    assert p0.kv_usage == pytest.approx(0.3)


def test_window_quantiles_and_rates_from_two_gateway_pods() -> None:
    a, b = FakeGateway(), FakeGateway()
    win = GatewayWindow(window_s=60.0)
    for v in (0.05,) * 10:  # before the window: must not count
        a.ttft.observe(v)
    win.add(
        "gw-a", Snapshot(0.0, parse_histograms(a.text()), parse_instances(instances(1000.0, 0.0)))
    )
    win.add("gw-b", Snapshot(0.0, parse_histograms(b.text())))
    for v in (0.3,) * 8 + (2.0,) * 2:
        a.ttft.observe(v)
    for v in (0.3,) * 5 + (4.0,) * 5:
        b.ttft.observe(v)
    for v in (0.02,) * 20:
        b.itl.observe(v)
    win.add(
        "gw-a",
        Snapshot(30.0, parse_histograms(a.text()), parse_instances(instances(7000.0, 1000.0))),
    )
    win.add("gw-b", Snapshot(30.0, parse_histograms(b.text())))
    obs = win.observations(COUNTS)
    assert obs is not None
    assert obs.requests == 20
    # 13 in (0.1, 0.5], 2 in (1, 2.5], 5 in (2.5, 5]: rank 18 lies in the last bucket
    assert obs.ttft_p90 == pytest.approx(2.5 + 2.5 * (18 - 15) / 5)
    assert obs.tpot_p90 == pytest.approx(0.1 * 18 / 20)
    p, d = obs.roles["prefill"], obs.roles["decode"]
    assert (p.ready, p.starting, p.waiting) == (2, 1, 3.0)
    assert p.prompt_tokens_per_s == pytest.approx((6000.0 - 1000.0) / 30.0)
    assert (d.ready, d.running, d.kv_usage) == (1, 3.0, 0.5)  # the unhealthy engine is left out
    assert d.waiting == 0.0  # requests parked for their KV are not a decode queue
    assert obs.observed_at == 30.0


def test_one_snapshot_is_no_window_and_restarts_are_not_negative() -> None:
    gw = FakeGateway()
    gw.ttft.observe(3.0)
    win = GatewayWindow(window_s=60.0)
    win.add(
        "gw", Snapshot(0.0, parse_histograms(gw.text()), parse_instances(instances(5000.0, 0.0)))
    )
    obs = win.observations(COUNTS)
    assert obs is not None and obs.requests == 0 and obs.ttft_p90 is None
    # the engine restarted: its counter went down, no rate from it this window
    win.add(
        "gw", Snapshot(15.0, parse_histograms(gw.text()), parse_instances(instances(10.0, 0.0)))
    )
    obs = win.observations(COUNTS)
    assert obs is not None and obs.roles["prefill"].prompt_tokens_per_s == 0.0


def test_window_slides_and_forgets_gone_pods() -> None:
    gw = FakeGateway()
    win = GatewayWindow(window_s=60.0)
    for t in range(0, 150, 15):
        gw.ttft.observe(0.3 if t < 60 else 4.0)
        win.add("gw", Snapshot(float(t), parse_histograms(gw.text())))
    ring = win.snapshots["gw"]
    assert ring[-1].at - ring[0].at == 60.0
    obs = win.observations(COUNTS)
    assert obs is not None and obs.requests == 4
    assert obs.ttft_p90 == pytest.approx(quantile(0.9, {2.5: 0.0, 5.0: 4.0, math.inf: 4.0}))
    win.forget([])
    assert win.observations(COUNTS) is None


def test_the_recent_rate_spans_the_newest_snapshots_only() -> None:
    gw = FakeGateway()
    win = GatewayWindow(window_s=60.0, recent_s=3.0)
    # 100 uncached tok/s for 20 s, then 1000 tok/s for the last 3 s
    for at, prompt in ((0.0, 0.0), (10.0, 1000.0), (20.0, 2000.0), (21.0, 3000.0)):
        win.add(
            "gw", Snapshot(at, parse_histograms(gw.text()), parse_instances(instances(prompt, 0.0)))
        )
    win.add(
        "gw", Snapshot(23.0, parse_histograms(gw.text()), parse_instances(instances(5000.0, 0.0)))
    )
    p = win.observations(COUNTS).roles["prefill"]  # type: ignore[union-attr]
    assert p.prompt_tokens_per_s == pytest.approx(5000.0 / 23.0)
    assert p.prompt_tokens_per_s_recent == pytest.approx((5000.0 - 2000.0) / 3.0)
    # without recent_s there is none; with one snapshot in the span, none either
    assert GatewayWindow(window_s=60.0).observations(COUNTS) is None
    lone = GatewayWindow(window_s=60.0, recent_s=0.5)
    lone.snapshots = win.snapshots
    assert lone.observations(COUNTS).roles["prefill"].prompt_tokens_per_s_recent is None  # type: ignore[union-attr]


def test_the_backlog_adds_every_gateway_pods_in_flight_prompts() -> None:
    def with_inflight(tokens: float) -> tuple[EngineLoad, ...]:
        loads = parse_instances(instances(0.0, 0.0))
        return tuple(replace(e, inflight_tokens=tokens) for e in loads)

    gw = FakeGateway()
    win = GatewayWindow(window_s=60.0)
    win.add("gw-a", Snapshot(0.0, parse_histograms(gw.text()), with_inflight(1000.0)))
    win.add("gw-b", Snapshot(0.0, parse_histograms(gw.text()), with_inflight(500.0)))
    win.add("gw-b", Snapshot(1.0, parse_histograms(gw.text()), with_inflight(700.0)))
    obs = win.observations(COUNTS)
    assert obs is not None
    # the newest snapshot of each pod; the unhealthy decode engine left out
    assert obs.roles["prefill"].backlog_tokens == 1700.0
    assert obs.roles["decode"].backlog_tokens == 1700.0
    assert (
        parse_instances(
            [
                {
                    "url": "u",
                    "role": "prefill",
                    "ranks": [{"inflight_tokens": 3}, {"inflight_tokens": 4}],
                }
            ]
        )[0].inflight_tokens
        == 7.0
    )
    # no instance list (histograms only): not measured
    bare = GatewayWindow(window_s=60.0)
    bare.add("gw", Snapshot(0.0, parse_histograms(gw.text())))
    assert bare.observations(COUNTS).roles["prefill"].backlog_tokens is None  # type: ignore[union-attr]
