"""Autoscaling benchmark: the real operator closing the loop over engines run as processes.

Everything runs for real on this machine: the local control plane (etcd, kube-apiserver,
controller manager, scheduler, kwok nodes), ``helm install`` of charts/dsv4, the operator with
the chart's ServiceAccount, one real gateway, and per instance StatefulSet a ``dsv4 engine`` +
``dsv4 kv-sidecar`` started by ``dsv4_devcluster.process_nodes.ProcessNodes`` (kwok pods run
no process). The load is ``dsv4 bench --schedule`` against the gateway.

The engines are EMULATED by default (``--emulate-step-time``): on two cores a second real
engine adds no capacity, so a scale-up could not fix anything. ``--engine-mode real`` runs
dsv4-tiny instead. The report says which.

Two profiles: prefill-heavy (long prompts, few output tokens) and decode-heavy (short prompts,
long answers). For each it prints:

- SLO attainment per schedule phase and for the whole run (share of the requests within both
  objectives), beside the static-max run's with ``--baseline``;
- for each load step: step -> first ScaledUp (decision) -> new engine Ready -> SLO recovered
  (first 5 s bin after the decision with >= 90% of its requests within both objectives);
- cold starts: for each instance made by a scale-up, decision -> StatefulSet seen -> pod bound
  -> processes started -> engine Ready;
- drain durations (DrainStarted -> DrainCompleted, per instance);
- failed requests (goal 0), and those sent while any instance was starting or draining;
- instance-seconds against static provisioning at max (goal <= 0.7x at equal attainment;
  ``--baseline`` also runs the schedule at static max to measure that attainment);
- direction changes per hour (up after down or down after up, per role);
- with ``--known-peak LEAD_S``, the same for a third run where the peak is declared
  (``scheduledMinimums``: the heavy role at its max from LEAD_S before the step to the peak's end).

    .venv/bin/python benchmarks/autoscaling.py --baseline            # the full run, ~20 min
    .venv/bin/python benchmarks/autoscaling.py --baseline --shape legacy
    .venv/bin/python benchmarks/autoscaling.py --baseline --known-peak 15   # + peak declared
    .venv/bin/python benchmarks/autoscaling.py --profiles decode-heavy --time-scale 0.5
    .venv/bin/python benchmarks/autoscaling.py --baseline --prompt-deadline 0   # FCFS engines
"""

from __future__ import annotations

import argparse
import calendar
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from autoscaling_analysis import TPOT_S, TTFT_S, Profile, analyse, phase_starts, read_records

from dsv4_common.ports import KV_PORT, sidecar_metrics_port
from dsv4_common.process import dsv4_argv
from dsv4_devcluster import ClusterConfig, FakeNodeSpec, LocalCluster
from dsv4_devcluster.binaries import ensure_binaries
from dsv4_devcluster.operator_process import OperatorService
from dsv4_devcluster.process_nodes import ProcessNodes

REPO = Path(__file__).resolve().parents[1]

RELEASE_NAMESPACE = "dsv4-system"
STEP_TIME = "20,3,0.2"
# the engines' SLO-aware prompt order (--prompt-deadline): a prompt's KV is due this long after
# it reaches the prefill engine, the rest of the 1 s TTFT left to the KV transfer and the
# decode's first step (docs/autoscaling.md, "The prompt order")
PROMPT_DEADLINE_S = 0.6


PROFILES = {
    # 300 words are about 1200 tokens of the byte-level tiny tokenizer: a 263 ms emulated
    # prefill step, so one prefill instance takes about 3.8 requests/s
    "prefill-heavy": Profile("prefill-heavy", [(30, 0.5), (60, 5), (120, 0.5)], 300, 8, 4500),
    # 128 tokens out: one decode instance at 2 requests/s runs about 22 sequences at 86 ms a
    # step (TPOT breached), two run about 4 each at 33 ms
    "decode-heavy": Profile("decode-heavy", [(30, 0.3), (60, 2), (120, 0.3)], 16, 128, 4500),
}
SHAPES = {
    # a peak that is shorter than the troughs around it, as diurnal traffic has (docs say why)
    "diurnal": None,
    # the first schedules (30 s low, 90 s high, 90 s low): the peak is 43% of the run
    "legacy": {
        "prefill-heavy": [(30, 0.5), (90, 5), (90, 0.5)],
        "decode-heavy": [(30, 0.3), (90, 2), (90, 0.3)],
    },
}


def _cr(name: str, p: Profile, autoscaled: bool, prompt_deadline: float) -> dict[str, Any]:
    cpu = {"npusPerNode": 0, "parallelism": {"tp": 1}, "resources": {"requests": {"cpu": "100m"}}}
    spec: dict[str, Any] = {
        "model": {"preset": "dsv4-tiny", "servedName": "tiny"},
        "prefill": dict(cpu, instances=1 if autoscaled else 2),
        "decode": dict(cpu, instances=1 if autoscaled else 2),
        "kvTransfer": {"transport": "tcp", "sidecarResources": {"requests": {"cpu": "100m"}}},
        "gateway": {"replicas": 1, "resources": {"requests": {"cpu": "100m"}}},
    }
    if autoscaled:
        spec["autoscaling"] = {
            "enabled": True,
            "ttftSeconds": TTFT_S,
            "tpotSeconds": TPOT_S,
            # 1 s ticks: a scale-up needs two short ticks (breach_ticks), so at 2 s ticks the
            # confirmation alone cost 2-4 s of the decision delay (docs/autoscaling.md)
            "intervalSeconds": 1,
            "windowSeconds": 10,
            "scaleDownStabilizationSeconds": 30,
            "drainTimeoutSeconds": 120,
            "prefill": {"min": 1, "max": 2, "tokensPerSecond": p.prefill_tokens_per_s},
            "decode": {"min": 1, "max": 2, "runningPerInstance": 8},
        }
    if prompt_deadline:
        # what the operator renders into the prefill pods (ProcessNodes runs the engines with
        # the benchmark's arguments: role_engine_args adds the same flag to the prefill engines)
        auto = spec.setdefault("autoscaling", {"ttftSeconds": TTFT_S})
        auto.setdefault("prefill", {})["promptDeadlineSeconds"] = prompt_deadline
    return {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DeepSeekV4Deployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def _epoch(ts: str) -> float:
    return float(calendar.timegm(time.strptime(ts, "%Y-%m-%dT%H:%M:%SZ")))


def _events(cluster: LocalCluster, ns: str, name: str) -> list[tuple[float, str, str]]:
    out = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}", "-o", "json"
    )
    items = json.loads(out)["items"]
    items.sort(key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [(_epoch(e["firstTimestamp"]), e["reason"], e["message"]) for e in items]


def _process_nodes(
    cluster: LocalCluster,
    ns: str,
    name: str,
    work: Path,
    engine_args: list[str],
    prompt_deadline: float,
) -> ProcessNodes:
    """The engines and sidecars of ``name``'s pods, as processes (the kubelet of the kwok pods)."""
    (work / ns).mkdir(parents=True, exist_ok=True)
    token = work / ns / "kv-token"
    token.write_text("b" * 32)
    nodes = ProcessNodes(
        cluster=cluster,
        namespace=ns,
        deployment=name,
        token_file=token,
        log_dir=work / ns,
        engine_args=engine_args,
        sidecar_metrics_port=sidecar_metrics_port(KV_PORT),
        role_engine_args=(
            {"prefill": ["--prompt-deadline", f"{prompt_deadline:g}"]} if prompt_deadline else {}
        ),
    )
    return nodes


def _wait_published(nodes: ProcessNodes, want: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if all(
            sum(1 for i in nodes.by_role(r) if i.published) >= want for r in ("prefill", "decode")
        ):
            break
        time.sleep(1)
    else:
        raise RuntimeError("engines did not come up")


def _bench_argv(p: Profile, url: str, records: Path) -> list[str]:
    schedule = ",".join(f"{s:g}s@{r:g}" for s, r in p.schedule)
    return dsv4_argv(
        "bench",
        *("--url", url, "--model", "tiny", "--json", "--no-progress", "--timeout", "300"),
        *("--schedule", schedule, "--records", str(records)),
        *("--input-len", str(p.input_len), "--output-len", str(p.output_len)),
        *("--ttft-slo", str(TTFT_S), "--tpot-slo", str(TPOT_S)),
    )


def _wait_drained(nodes: ProcessNodes) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (
        len(nodes.by_role("prefill")) > 1 or len(nodes.by_role("decode")) > 1
    ):
        time.sleep(1)


def run_profile(
    cluster: LocalCluster,
    op_kubeconfig: Path,
    p: Profile,
    ns: str,
    autoscaled: bool,
    engine_args: list[str],
    work: Path,
    prompt_deadline: float,
    known_peak_lead: float | None = None,
) -> dict[str, Any]:
    """``known_peak_lead``: the peak is declared (``scheduledMinimums``, the profile's heavy role
    at its max from this many seconds before each step up until the peak ends)."""
    cluster.kubectl("create", "namespace", ns)
    name = "bench"
    cr = _cr(name, p, autoscaled, prompt_deadline)
    nodes = _process_nodes(cluster, ns, name, work, engine_args, prompt_deadline)
    op = OperatorService(
        op_kubeconfig, cluster.log_dir, ("--autoscaler-address-map", str(nodes.address_map))
    ).launch()
    try:
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(cr))
        nodes.start()
        gw = nodes.start_gateway()
        _wait_published(nodes, 1 if autoscaled else 2)
        time.sleep(3)  # the gateway's first health round
        records = work / ns / "records.jsonl"
        argv = _bench_argv(p, gw.url, records)
        t0 = time.time()
        if known_peak_lead is not None:
            windows = _known_peaks(p, t0, known_peak_lead)
            patch = {"spec": {"autoscaling": {"scheduledMinimums": windows}}}
            cluster.kubectl(
                "patch", "dsv4", name, "-n", ns, "--type", "merge", "-p", json.dumps(patch)
            )
        res = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
        if res.returncode != 0:
            raise RuntimeError(f"bench failed: {res.stderr[-2000:]}")
        if autoscaled:  # let the last drains finish inside the measurement
            _wait_drained(nodes)
        t1 = time.time()
        out = analyse(
            p,
            t0,
            read_records(records),
            _events(cluster, ns, name),
            nodes.history,
            t1,
            lead=known_peak_lead or 0.0,
        )
        out["bench"] = {k: v for k, v in json.loads(res.stdout).items() if k != "phases"}
        return out
    finally:
        op.stop()
        nodes.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


def _known_peaks(p: Profile, t0: float, lead: float) -> list[dict[str, Any]]:
    """What a user who knows the peaks declares: per step up, the heavy role at its max (2) from
    ``lead`` seconds before the step to the end of the phase (UTC times of day)."""

    def utc(t: float) -> str:
        return time.strftime("%H:%M:%S", time.gmtime(t))

    role = "prefill" if p.name == "prefill-heavy" else "decode"
    return [
        {"name": f"peak-{i}", "start": utc(start - lead), "end": utc(start + sec), role: 2}
        for i, ((sec, rate), start) in enumerate(zip(p.schedule, phase_starts(p, t0), strict=True))
        if i and rate > p.schedule[i - 1][1]
    ]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _print(name: str, mode: str, auto: dict[str, Any], static: dict[str, Any] | None) -> None:
    print(f"\n== {name} ({mode}) ==")
    for i, ph in enumerate(auto["phases"]):
        base = static["phases"][i]["slo_attainment"] if static else None
        print(
            f"phase {i}: {ph['seconds']:g}s @ {ph['rate']:g}/s  {ph['requests']} requests, "
            f"{ph['failed']} failed, SLO attainment {_pct(ph['slo_attainment'])}"
            + ("" if static is None else f" (static max: {_pct(base)})")
        )
    print(
        f"whole run: SLO attainment {_pct(auto['slo_attainment'])}"
        + ("" if static is None else f" (static max: {_pct(static['slo_attainment'])})")
    )

    def after(x: float | None) -> str:
        return "never" if x is None else f"{x:+g}s"

    for s in auto["steps"]:
        print(
            f"load step into phase {s['phase']}: decision {after(s['decision_s'])}, "
            f"Ready {after(s['ready_s'])}, SLO recovered {after(s['recovered_s'])}"
        )
    for c in auto["cold_starts"]:
        print(
            f"cold start {c['instance']} (decision at +{c['decision_at_s']:g}s): "
            + ", ".join(
                f"{what} {after(c.get(f'{what}_s'))}"
                for what in ("created", "scheduled", "started", "ready")
            )
        )
    for d in auto["drains"]:
        secs = "-" if d["seconds"] is None else f"{d['seconds']:.0f}s"
        print(f"drain {d['instance']}: {secs} ({d['outcome']})")
    print(
        f"failed requests: {auto['failed']} ({auto['failed_near_scaling']} within 30 s of a "
        "scaling action; goal 0)"
    )
    print(
        f"instance-seconds {auto['instance_seconds']:.0f} vs static max "
        f"{auto['static_max_instance_seconds']:.0f}: {auto['vs_static_max']:.2f}x (goal <= 0.7x)"
    )
    print(f"direction changes per hour: {auto['direction_changes_per_hour']:.1f}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--profiles", nargs="+", choices=sorted(PROFILES), default=sorted(PROFILES))
    ap.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply every phase's length (e.g. 0.5)"
    )
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="diurnal",
        help="diurnal: 30 s low, 60 s high, 120 s low; legacy: 30 s low, 90 s high, 90 s low",
    )
    ap.add_argument("--engine-mode", choices=["emulated", "real"], default="emulated")
    ap.add_argument("--step-time", default=STEP_TIME, help="emulated base,per_seq,per_token ms")
    ap.add_argument(
        "--baseline", action="store_true", help="also run each schedule at static max (2 + 2)"
    )
    ap.add_argument(
        "--prompt-deadline",
        type=float,
        default=PROMPT_DEADLINE_S,
        help="the engines' SLO-aware prompt order, seconds (0: first come, first served); the "
        "same in the autoscaled and the static-max runs",
    )
    ap.add_argument(
        "--known-peak",
        type=float,
        metavar="LEAD_S",
        help="also run each profile autoscaled with the peak declared: scheduledMinimums raise "
        "the heavy role to its max LEAD_S seconds before each step up, until the peak ends",
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead")
    ap.add_argument(
        "--json-out", type=Path, help="also write the results as JSON here (scale events included)"
    )
    return ap


def engine_mode(args: argparse.Namespace) -> tuple[list[str], str]:
    """The engines' arguments and the line that names their mode in the report."""
    engine_args = ["--num-speculative-tokens", "0", "--num-kv-blocks", "600"]
    engine_args += ["--max-model-len", "2048"]
    if args.engine_mode == "emulated":
        engine_args += ["--emulate-step-time", args.step_time]
        mode = f"EMULATED engines, step = {args.step_time} ms (base, per sequence, per token)"
    else:
        mode = "REAL dsv4-tiny engines on CPU"
    if args.prompt_deadline:
        mode += f"; prefill prompt order: deadline {args.prompt_deadline:g} s"
    else:
        mode += "; prompt order: first come, first served"
    return engine_args, mode


def run_one(
    args: argparse.Namespace,
    cluster: LocalCluster,
    op_kc: Path,
    i: int,
    name: str,
    engine_args: list[str],
    work: Path,
    mode: str,
) -> dict[str, Any]:
    """One profile autoscaled, and at static max and with the peak declared when asked."""
    base = PROFILES[name]
    shape = SHAPES[args.shape]
    schedule = base.schedule if shape is None else shape[name]
    p = Profile(
        name,
        [(s * args.time_scale, r) for s, r in schedule],
        base.input_len,
        base.output_len,
        base.prefill_tokens_per_s,
    )
    dl = args.prompt_deadline
    auto = run_profile(cluster, op_kc, p, f"auto-{i}", True, engine_args, work, dl)
    static = None
    if args.baseline:
        static = run_profile(cluster, op_kc, p, f"static-{i}", False, engine_args, work, dl)
    known = None
    if args.known_peak is not None:
        known = run_profile(
            cluster, op_kc, p, f"known-{i}", True, engine_args, work, dl, args.known_peak
        )
    if not args.json:
        _print(f"{name}, {args.shape} shape", mode, auto, static)
        if known is not None:
            title = f"{name}, {args.shape} shape, peak declared {args.known_peak:g} s ahead"
            _print(title, mode, known, static)
    return {"autoscaled": auto, "static_max": static, "known_peak": known}


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    if args.time_scale <= 0:
        ap.error("--time-scale must be > 0")
    if args.known_peak is not None and args.known_peak <= 0:
        ap.error("--known-peak must be > 0 seconds")
    if not 0 <= args.prompt_deadline <= TTFT_S:
        ap.error(f"--prompt-deadline must be in [0, {TTFT_S:g}] (the TTFT objective)")
    engine_args, mode = engine_mode(args)

    work = Path(tempfile.mkdtemp(prefix="dsv4-bench-autoscaling-"))
    bin_dir = ensure_binaries()
    cluster = LocalCluster(
        ClusterConfig(bin_dir=bin_dir, work_dir=work, node_spec=FakeNodeSpec(pods=110))
    )
    results: dict[str, Any] = {"engine_mode": mode, "shape": args.shape, "profiles": {}}
    with cluster:
        cluster.start_workloads(2)
        cluster.install_chart(REPO / "charts" / "dsv4", RELEASE_NAMESPACE)
        op_kc = cluster.service_account_kubeconfig(RELEASE_NAMESPACE, "dsv4-operator")
        for i, name in enumerate(args.profiles):
            results["profiles"][name] = run_one(
                args, cluster, op_kc, i, name, engine_args, work, mode
            )
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=2))
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
