"""Operator benchmark: time from `kubectl create` to every child created and to Ready, for 1 and
for N DeepSeekV4Deployments at once, the operator's memory, and the Kubernetes API requests one
sync of an unchanged deployment makes, by verb (the goal: none, everything it reads is in the
operator's watch cache).

Runs everything for real on this machine: the local control plane (etcd, kube-apiserver,
controller manager, scheduler, kwok fake Ascend nodes), `helm install` of charts/dsv4, and the
operator as a process with the chart's ServiceAccount. Nothing is timed inside the operator; the
clock is the client's, which watches (``kubectl get -w``) rather than polls.

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
import threading
import time
from pathlib import Path
from typing import Any

from dsv4_common.process import metric_value
from dsv4_devcluster import ClusterConfig, FakeNodeSpec, LocalCluster
from dsv4_devcluster.binaries import ensure_binaries
from dsv4_devcluster.operator_process import OperatorService

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


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


class Watch:
    """``kubectl get -w`` of each child kind and of the CRs, each line timestamped as it arrives:
    what the client sees, without re-listing 1,500 objects every poll (on a 2-core machine that
    polling would cost more CPU than the operator under test)."""

    def __init__(self, cluster: LocalCluster, ns: str) -> None:
        self.t0 = time.monotonic()
        self.children: dict[str, float] = {}  # "kind/name" -> first seen
        self.phases: dict[str, tuple[str, float]] = {}  # CR name -> (last phase, since)
        self.lock = threading.Lock()
        base = [str(cluster.config.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig)]
        base += ["get", "-n", ns, "-w"]
        self.procs = [
            subprocess.Popen(
                [*base, kind, "-l", "app.kubernetes.io/managed-by=dsv4-operator", "-o", "name"],
                stdout=subprocess.PIPE,
                text=True,
            )
            for kind in KINDS.split(",")
        ]
        self.procs.append(
            subprocess.Popen(
                [
                    *base,
                    "dsv4",
                    "--no-headers",
                    "-o",
                    "custom-columns=N:.metadata.name,P:.status.phase",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        self.threads = [
            threading.Thread(target=self._read, args=(p, i == len(self.procs) - 1), daemon=True)
            for i, p in enumerate(self.procs)
        ]
        for t in self.threads:
            t.start()

    def _read(self, proc: subprocess.Popen[str], crs: bool) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.monotonic() - self.t0
            with self.lock:
                if crs:
                    name, phase = [*line.split(), "", ""][:2]
                    if self.phases.get(name, ("", 0.0))[0] != phase:
                        self.phases[name] = (phase, now)
                else:
                    self.children.setdefault(line.strip(), now)

    def created(self, names: list[str]) -> dict[str, float]:
        """CR -> when the last of its children appeared (for those with all of them)."""
        by_owner: dict[str, list[float]] = {}
        with self.lock:
            for ref, at in self.children.items():
                owner = ref.split("/", 1)[1].split("-", 1)[0]  # children are named "{cr}-..."
                by_owner.setdefault(owner, []).append(at)
        return {x: max(by_owner[x]) for x in names if len(by_owner.get(x, ())) >= CHILDREN_PER_CR}

    def ready(self) -> dict[str, float]:
        with self.lock:
            return {x: at for x, (phase, at) in self.phases.items() if phase == "Ready"}

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
            p.wait()


def run_round(
    cluster: LocalCluster, op: OperatorService, n: int, ns: str, timeout_s: float
) -> dict[str, Any]:
    cluster.kubectl("create", "namespace", ns)
    names = [f"b{i}" for i in range(n)]
    doc = {"apiVersion": "v1", "kind": "List", "items": [_cr(x) for x in names]}
    before = _requests(op)
    assert op.pid is not None
    cpu_before = _cpu_s(op.pid)
    watch = Watch(cluster, ns)
    time.sleep(1.0)  # let the watches start
    watch.t0 = t0 = time.monotonic()
    cluster.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(doc))
    applied = time.monotonic() - t0
    deadline = t0 + timeout_s
    try:
        while len(watch.ready()) < n and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        watch.stop()
    wall = time.monotonic() - t0
    after = _requests(op)
    cpu = _cpu_s(op.pid) - cpu_before
    return {
        "operator_cpu_s": cpu,
        "n": n,
        "created": list(watch.created(names).values()),
        "ready": list(watch.ready().values()),
        "wall": wall,
        "create_s": applied,
        "requests": {k: after[k] - before[k] for k in after},
    }


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
        cluster.install_chart(REPO / "charts" / "dsv4", RELEASE_NAMESPACE)
        op = OperatorService(
            cluster.service_account_kubeconfig(RELEASE_NAMESPACE, "dsv4-operator"), cluster.log_dir
        ).launch()
        one_sync: dict[str, float] = {}
        try:
            assert op.pid is not None
            idle_rss, _ = _rss_mb(op.pid)
            for i, n in enumerate(args.counts):
                ns = f"bench-{i}"
                r = run_round(cluster, op, n, ns, args.timeout)
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
    for r in results:
        reqs = ", ".join(f"{v} {r['requests'][v]:g}" for v in VERBS)
        print(
            f"{r['n']} CRs: `kubectl create` returned after {r['create_s']:.2f}s; in "
            f"{r['wall']:.1f}s the operator used {r['operator_cpu_s']:.1f} CPU-s and ran "
            f"{r['requests']['syncs']:g} syncs making {reqs}"
        )
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
