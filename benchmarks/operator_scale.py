"""Operator benchmark: time from `kubectl apply` to every child created and to Ready, for 1 and
for N DeepSeekV4Deployments at once, the operator's memory, and the Kubernetes API requests one
sync of an unchanged deployment makes, by verb (the goal: reads only).

Runs everything for real on this machine: the local control plane (etcd, kube-apiserver,
controller manager, scheduler, kwok fake Ascend nodes), `helm install` of charts/dsv4, and the
operator as a process with the chart's ServiceAccount. Nothing is timed inside the operator; the
clock is the client's.

    .venv/bin/python benchmarks/operator_scale.py            # 1 and 100 CRs
    .venv/bin/python benchmarks/operator_scale.py --counts 1 10 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dsv4_common.process import metric_value
from dsv4_operator.devcluster import ClusterConfig, FakeNodeSpec, LocalCluster
from dsv4_operator.devcluster.binaries import ensure_binaries
from dsv4_operator.devcluster.operator_process import OperatorService

REPO = Path(__file__).resolve().parents[1]
RELEASE_NAMESPACE = "dsv4-system"
VERBS = ("get", "list", "apply", "delete", "patch_status", "create")

KINDS = "statefulsets,deployments,services,configmaps,secrets,serviceaccounts,roles,rolebindings,poddisruptionbudgets,networkpolicies"
CHILDREN_PER_CR = 15  # what the tiny CPU example owns (see tests/k8s/test_operator.py)


def _cr(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DeepSeekV4Deployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"preset": "dsv4-tiny", "servedName": name},
            "prefill": {
                "npusPerNode": 0,
                "parallelism": {"tp": 1},
                "resources": {"requests": {"cpu": "100m"}},
            },
            "decode": {
                "npusPerNode": 0,
                "parallelism": {"tp": 1},
                "resources": {"requests": {"cpu": "100m"}},
            },
            "kvTransfer": {"transport": "tcp", "sidecarResources": {"requests": {"cpu": "100m"}}},
            "gateway": {"resources": {"requests": {"cpu": "100m"}}},
        },
    }


def _rss_mb(pid: int) -> tuple[float, float]:
    fields = dict(
        line.split(":", 1)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _requests(op: OperatorService) -> dict[str, float]:
    text = op.metrics_text()
    out = {v: metric_value(text, "dsv4_operator_api_requests_total", verb=v) for v in VERBS}
    out["syncs"] = metric_value(text, "dsv4_operator_syncs_total")
    return out


def _quiet(op: OperatorService, settle_s: float = 2.0, timeout_s: float = 60.0) -> dict[str, float]:
    """The request counters once they have not moved for ``settle_s``."""
    last, since = _requests(op), time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _requests(op)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return now
    return last


def requests_of_one_sync(
    cluster: LocalCluster, op: OperatorService, ns: str, name: str
) -> dict[str, float]:
    """Touch an annotation of a Ready deployment (no spec change: its sync has nothing to do) and
    count the operator's API requests per sync that follows, by verb."""
    before = _quiet(op)
    cluster.kubectl("annotate", "dsv4", name, "-n", ns, f"bench/poke={time.time()}", "--overwrite")
    deadline = time.monotonic() + 30
    while _requests(op)["syncs"] <= before["syncs"] and time.monotonic() < deadline:
        time.sleep(0.2)
    after = _quiet(op)
    syncs = max(1.0, after["syncs"] - before["syncs"])
    return {v: (after[v] - before[v]) / syncs for v in VERBS} | {
        "syncs": after["syncs"] - before["syncs"]
    }


def run_round(cluster: LocalCluster, n: int, ns: str, timeout_s: float) -> dict[str, Any]:
    cluster.kubectl("create", "namespace", ns)
    names = [f"b{i}" for i in range(n)]
    doc = {"apiVersion": "v1", "kind": "List", "items": [_cr(x) for x in names]}
    t0 = time.monotonic()
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
    created: dict[str, float] = {}
    ready: dict[str, float] = {}
    deadline = t0 + timeout_s
    while len(ready) < n and time.monotonic() < deadline:
        now = time.monotonic() - t0
        items = json.loads(
            cluster.kubectl(
                "get",
                KINDS,
                "-n",
                ns,
                "-l",
                "app.kubernetes.io/managed-by=dsv4-operator",
                "-o",
                "json",
            )
        )["items"]
        counts: dict[str, int] = {}
        for o in items:
            owner = o["metadata"]["labels"].get("app.kubernetes.io/instance", "")
            counts[owner] = counts.get(owner, 0) + 1
        for x in names:
            if x not in created and counts.get(x, 0) >= CHILDREN_PER_CR:
                created[x] = now
        for o in json.loads(cluster.kubectl("get", "dsv4", "-n", ns, "-o", "json"))["items"]:
            x = o["metadata"]["name"]
            if x not in ready and (o.get("status") or {}).get("phase") == "Ready":
                ready[x] = now
        time.sleep(0.2)
    wall = time.monotonic() - t0
    return {"n": n, "created": list(created.values()), "ready": list(ready.values()), "wall": wall}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--counts", type=int, nargs="+", default=[1, 100], help="CRs applied at once, per round"
    )
    p.add_argument("--nodes", type=int, default=4, help="fake nodes (110 pods each)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per round")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args()
    if any(c < 1 for c in args.counts):
        p.error("--counts must be >= 1")

    work = Path(tempfile.mkdtemp(prefix="dsv4-bench-operator-"))
    bin_dir = ensure_binaries()
    cluster = LocalCluster(
        ClusterConfig(bin_dir=bin_dir, work_dir=work, node_spec=FakeNodeSpec(pods=110))
    )
    results = []
    with cluster:
        cluster.start_workloads(args.nodes)
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "HOME": str(work)}
        subprocess.run(
            [
                str(bin_dir / "helm"),
                "install",
                "dsv4",
                str(REPO / "charts" / "dsv4"),
                "-n",
                RELEASE_NAMESPACE,
                "--create-namespace",
            ],
            check=True,
            capture_output=True,
            env=env,
        )
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/deepseekv4deployments.serving.dsv4.io"
        )
        op = OperatorService(
            cluster.service_account_kubeconfig(RELEASE_NAMESPACE, "dsv4-operator"), cluster.log_dir
        ).launch()
        one_sync: dict[str, float] = {}
        try:
            assert op.pid is not None
            idle_rss, _ = _rss_mb(op.pid)
            for i, n in enumerate(args.counts):
                ns = f"bench-{i}"
                r = run_round(cluster, n, ns, args.timeout)
                if not one_sync and r["ready"]:
                    one_sync = requests_of_one_sync(cluster, op, ns, "b0")
                cluster.kubectl("delete", "namespace", ns, "--wait=false")
                r["rss_mb"], r["peak_rss_mb"] = _rss_mb(op.pid)
                r["idle_rss_mb"] = idle_rss
                results.append(r)
        finally:
            op.stop()

    if args.json:
        print(json.dumps({"rounds": results, "one_unchanged_sync": one_sync}, indent=2))
        return 0
    print(
        f"\nOperator scale benchmark ({os.cpu_count()} CPUs, {args.nodes} kwok nodes, tiny CPU CRs of {CHILDREN_PER_CR} children)\n"
    )
    hdr = f"{'CRs':>5} | {'children p50':>12} {'p95':>7} | {'Ready p50':>9} {'p95':>7} | {'done':>9} | {'RSS MB':>7} {'peak':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        c, rd = r["created"], r["ready"]
        fmt = lambda xs, q: f"{_pct(xs, q):.2f}s" if xs else "-"  # noqa: E731
        print(
            f"{r['n']:>5} | {fmt(c, 0.5):>12} {fmt(c, 0.95):>7} | {fmt(rd, 0.5):>9} {fmt(rd, 0.95):>7} | "
            f"{len(rd):>4}/{r['n']:<4} | {r['rss_mb']:>7.0f} {r['peak_rss_mb']:>6.0f}"
        )
    print(f"\noperator RSS when idle: {results[0]['idle_rss_mb']:.0f} MB" if results else "")
    if one_sync:
        calls = ", ".join(f"{v} {one_sync[v]:g}" for v in VERBS)
        writes = sum(one_sync[v] for v in VERBS if v not in ("get", "list"))
        print(
            f"API requests of one sync of an unchanged deployment ({one_sync['syncs']:g} syncs "
            f"seen): {calls}; writes: {writes:g}"
        )
    if results and statistics.mean(len(r["ready"]) / r["n"] for r in results) < 1:
        print("some CRs did not reach Ready within --timeout")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
