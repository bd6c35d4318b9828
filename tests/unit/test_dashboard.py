"""The Grafana dashboard shipped in the chart: well-formed, and every series it queries is one
that our engines, gateway or KV sidecar export (a renamed metric breaks this test, not the
dashboard in production)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_serving.entrypoints.metrics import EngineMetrics
from dsv4_serving.gateway.metrics import GatewayMetrics

DASHBOARDS = Path(__file__).resolve().parents[2] / "charts" / "dsv4" / "dashboards"
METRIC = re.compile(r"\b((?:vllm:|dsv4_)[A-Za-z0-9_:]+)\b(?!\s*=)")  # not label names
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def all_exported() -> set[str]:
    return (
        exported(EngineMetrics("m").registry)
        | exported(GatewayMetrics().registry)
        | exported(SidecarMetrics().registry)
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
                used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
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
