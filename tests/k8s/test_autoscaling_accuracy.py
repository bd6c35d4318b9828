"""The windowed p90 TTFT and TPOT the autoscaler computes agree with what ``dsv4 bench``
measures at the client, within one histogram bucket, from both metrics sources: the gateway
(``GatewayWindow`` over two snapshots of the real gateway's /metrics, what the loop does each
tick) and Prometheus (the loop's ``Queries`` against a real Prometheus scraping that gateway).

REAL engines (two dsv4-tiny ``both`` engines behind a real gateway): accuracy is about how
latency is measured, not capacity. The autoscaler's TPOT is the gateway's inter-token latency
histogram (vLLM's), so it is compared with the bench's ITL p90; the bench's per-request TPOT
p90 is printed next to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest

from dsv4_common.process import dsv4_argv
from dsv4_operator.autoscaling.gateway_source import (
    GatewayWindow,
    RoleCounts,
    Snapshot,
    parse_histograms,
)
from dsv4_operator.autoscaling.histogram import bucket_of
from dsv4_operator.autoscaling.prometheus_source import Queries, scalar
from tests.gateway.conftest import engine, gateway, running
from tests.helpers import wait_for
from tests.k8s.prometheus_server import PrometheusService
from tests.k8s.prometheus_server import available as prometheus_available

# the gateway's latency buckets (gateway/metrics.py)
BOUNDS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]


def _snapshot(url: str) -> Snapshot:
    return Snapshot(time.time(), parse_histograms(httpx.get(f"{url}/metrics", timeout=5).text))


def _query(prom: str, promql: str) -> float | None:
    q = urllib.parse.urlencode({"query": promql})
    return scalar(httpx.get(f"{prom}/api/v1/query?{q}", timeout=10).json())


@pytest.mark.skipif(not prometheus_available(), reason="needs the prometheus binary")
def test_autoscaler_p90_agrees_with_the_bench_within_one_bucket(tmp_path: Path) -> None:
    a = engine("acc-a", "--num-speculative-tokens", "0", "--num-kv-blocks", "300")
    b = engine("acc-b", "--num-speculative-tokens", "0", "--num-kv-blocks", "300")
    g = gateway("acc-gateway", "--engine", a.url, "--engine", b.url)
    prom = PrometheusService(tmp_path / "prom", g.url.removeprefix("http://"), "acc", "ns")
    # all four start at once (the gateway health-checks the engines until they answer)
    with running(a, b, g, prom):
        q = Queries("acc", "ns", 0)
        sel = q._m("vllm:time_to_first_token_seconds_count", "gateway")
        wait_for("a first scrape", lambda: _query(prom.url, f"count({sel})"), 30)
        time.sleep(2.5)  # a scrape of the quiet gateway: the window's start
        window = GatewayWindow(3600.0)
        window.add("gw", _snapshot(g.url))
        t0 = time.time()
        res = subprocess.run(
            dsv4_argv(
                "bench",
                *("--url", g.url, "--json", "--no-progress", "--seed", "5"),
                *("--num-requests", "60", "--concurrency", "6"),
                *("--input-len", "48", "--input-range", "0.5", "--output-len", "16"),
            ),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-2000:]
        bench = json.loads(res.stdout)
        assert bench["failed"] == 0
        window.add("gw", _snapshot(g.url))
        time.sleep(2.5)  # Prometheus' next scrape has every request
        span = int(time.time() - t0) + 4
        promq = Queries("acc", "ns", float(span)).all()
        prom_ttft = _query(prom.url, promq["ttft_p90"])
        prom_tpot = _query(prom.url, promq["tpot_p90"])

    counts = {r: RoleCounts(ready=1) for r in ("prefill", "decode")}
    obs = window.observations(counts)  # type: ignore[arg-type]
    assert obs is not None and obs.requests == 60
    client = {"ttft": bench["ttft_s"]["p90"], "tpot": bench["itl_s"]["p90"]}
    ours = {
        "gateway": {"ttft": obs.ttft_p90, "tpot": obs.tpot_p90},
        "prometheus": {"ttft": prom_ttft, "tpot": prom_tpot},
    }
    print(
        f"\np90 client ttft {client['ttft']:.4f}s itl {client['tpot']:.4f}s "
        f"(per-request tpot {bench['tpot_s']['p90']:.4f}s); autoscaler {ours}",
        file=sys.stderr,
    )
    for source, got in ours.items():
        for key in ("ttft", "tpot"):
            value = got[key]
            assert value is not None, (source, key)
            off = abs(bucket_of(value, BOUNDS) - bucket_of(client[key], BOUNDS))
            assert off <= 1, (source, key, value, client[key])
