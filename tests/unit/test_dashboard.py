"""The Grafana dashboard shipped in the chart: well-formed, and every series it queries is one
that our engines, gateway or KV sidecar export (a renamed metric breaks this test, not the
dashboard in production)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_operator.autoscaling import report
from dsv4_serving.entrypoints.metrics import EngineMetrics
from dsv4_serving.gateway.metrics import GatewayMetrics

DASHBOARDS = Path(__file__).resolve().parents[2] / "charts" / "dsv4" / "dashboards"
METRIC = re.compile(r"\b((?:vllm:|dsv4_)[A-Za-z0-9_:]+)\b(?!\s*=)")  # not label names
GRAFANA_GLOBALS = {"__rate_interval", "__range", "__interval"}  # Grafana's built-in variables
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def all_exported() -> set[str]:
    autoscaler = CollectorRegistry()
    for m in (report.DESIRED, report.SIGNAL, report.DECISIONS, report.METRICS_AGE):
        autoscaler.register(m)
    return (
        exported(EngineMetrics("m").registry)
        | exported(GatewayMetrics().registry)
        | exported(SidecarMetrics().registry)
        | exported(autoscaler)
    )


def test_dashboards_are_well_formed() -> None:
    files = sorted(DASHBOARDS.glob("*.json"))
    assert files
    for f in files:
        d = json.loads(f.read_text())
        assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{f.name}: panel ids repeat"
        variables = {v["name"] for v in d["templating"]["list"]}
        for p in d["panels"]:
            assert p["targets"], p["title"]
            for t in p["targets"]:
                used = set(re.findall(r"\$(\w+)", t["expr"])) - GRAFANA_GLOBALS
                assert used <= variables, (p["title"], used - variables)


def test_every_queried_metric_is_exported() -> None:
    have = all_exported()
    missing = {}
    for f in DASHBOARDS.glob("*.json"):
        d = json.loads(f.read_text())
        for p in d["panels"]:
            for t in p["targets"]:
                for name in METRIC.findall(t["expr"]):
                    if name not in have:
                        missing[name] = p["title"]
    assert not missing, missing


# what issue 18 asks the dashboard to show, and a series each must query
WANTED = {
    "TTFT p90 by role": "vllm:time_to_first_token_seconds_bucket",
    "TPOT (mean) by role": "vllm:generation_tokens_total",
    "ITL p90 by role": "vllm:inter_token_latency_seconds_bucket",
    "Requests waiting and running": "vllm:num_requests_waiting",
    "Queueing": "dsv4_kv_requests_waiting_for_remote_kv",
    "KV cache usage": "vllm:kv_cache_usage_perc",
    "Prefix-cache hit rate": "vllm:prefix_cache_hits_total",
    "KV transfer bandwidth": "dsv4_kv_transfer_bytes_total",
    "KV transfer failures": "dsv4_kv_pull_failures_total",
    "MTP acceptance": "vllm:spec_decode_num_accepted_tokens_total",
    "Gateway retries and ejections": "dsv4_gateway_ejections_total",
    "Autoscaler": "dsv4_autoscaler_decisions_total",
}


def test_the_issues_panels_are_there() -> None:
    d = json.loads((DASHBOARDS / "dsv4-overview.json").read_text())
    for title, series in WANTED.items():
        panels = [p for p in d["panels"] if p["title"].startswith(title)]
        assert panels, f"no panel {title!r}"
        assert any(series in t["expr"] for p in panels for t in p["targets"]), (title, series)
