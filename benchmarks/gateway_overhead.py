"""What the gateway adds: latency (p50, p99) and sustained requests/s for PD requests against fast
upstreams on 127.0.0.1, beside vLLM's Rust router (`vllm-router --vllm-pd-disaggregation`) on the
same upstreams in the same run. The baseline is the client doing prefill then decode itself.

    .venv/bin/python benchmarks/gateway_overhead.py [--requests 400] [--concurrency 32]

``--span-cpu N`` measures instead what tracing costs per request in CPU, in this process: the
gateway's own tracing calls (a request span, a prefill and a decode attempt with their
``traceparent``) N times, exporting to ``--otlp-traces-endpoint``, then a flush.

vllm-router is installed on first use into ~/.cache/dsv4/vllm-router-venv (PyPI `vllm-router`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from dsv4_common.process import Service, dsv4_argv, free_port
from dsv4_devcluster.vllm_router import ROUTER_VERSION, ensure_vllm_router, router_argv

STUB = Path(__file__).resolve().parent / "upstream_stub.py"


BODY = {"model": "stub", "prompt": "hello " * 32, "max_tokens": 16, "temperature": 0}


async def via_router(client: httpx.AsyncClient, base: str) -> None:
    r = await client.post(f"{base}/v1/completions", json=BODY)
    if r.status_code != 200:
        raise RuntimeError(f"{base}: HTTP {r.status_code}: {r.text[:200]}")


def direct(prefills: list[str], decodes: list[str]) -> Any:
    counter = iter(range(1 << 62))

    async def call(client: httpx.AsyncClient, _: str) -> None:
        i = next(counter)
        p = await client.post(
            f"{prefills[i % len(prefills)]}/v1/completions",
            json={
                **BODY,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        params = p.json()["kv_transfer_params"]
        d = await client.post(
            f"{decodes[i % len(decodes)]}/v1/completions",
            json={**BODY, "kv_transfer_params": params},
        )
        if d.status_code != 200:
            raise RuntimeError(d.text)

    return call


async def measure(call: Any, base: str, requests: int, concurrency: int) -> dict[str, float]:
    limits = httpx.Limits(
        max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2
    )
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        for _ in range(20):  # warm connections and code paths
            await call(client, base)
        lat = []
        for _ in range(requests):  # latency: one at a time
            t = time.perf_counter()
            await call(client, base)
            lat.append(time.perf_counter() - t)
        sem = asyncio.Semaphore(concurrency)
        errors = 0

        async def one() -> None:
            nonlocal errors
            async with sem:
                try:
                    await call(client, base)
                except (httpx.HTTPError, RuntimeError):  # counted and shown, never fatal
                    errors += 1

        n = requests * 4
        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        rps = (n - errors) / (time.perf_counter() - t)
    lat.sort()
    return {
        "p50": statistics.median(lat),
        "p99": lat[int(0.99 * (len(lat) - 1))],
        "rps": rps,
        "errors": errors,
    }


def span_cpu(endpoint: str, n: int) -> dict[str, float]:
    """CPU per traced request (us): the caller's thread (the event loop's share), and the whole
    process with the export (encoding and POST on the exporter's thread, and the final flush)."""
    from dsv4_serving.gateway import tracing
    from dsv4_serving.gateway.instances import Instance
    from dsv4_serving.gateway.policies import Choice

    recorder = tracing.setup(endpoint)
    choice = Choice(Instance("http://127.0.0.1:1", "prefill"), 0, 16)

    def one(i: int) -> None:
        with (
            tracing.request_span(recorder, {}, BODY, False, f"r{i}", lambda: "ok") as span,
            tracing.routing(span),
        ):
            for role in ("prefill", "decode"):
                with tracing.attempt_span(recorder, role, choice, 0, "dplb") as a:
                    a.traceparent()
                    tracing.upstream_status(a, 200)

    for i in range(min(n, 500)):  # warm the code paths, the connection, the encoding's cache
        one(i)
    tracing.flush()
    c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    for i in range(n):
        one(i)
    t1, w1 = time.thread_time(), time.perf_counter()
    tracing.flush()
    c2 = time.process_time()
    return {
        "request_path_us": 1e6 * (t1 - t0) / n,
        "with_export_us": 1e6 * (c2 - c0) / n,
        "wall_us": 1e6 * (w1 - w0) / n,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--requests",
        type=int,
        default=400,
        help="sequential requests for latency (x4 for throughput)",
    )
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--span-cpu",
        type=int,
        metavar="N",
        help="only measure the CPU per request of the gateway's tracing calls (N requests, "
        "needs --otlp-traces-endpoint)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="also measure a second gateway tracing every request to this OTLP/HTTP endpoint "
        "(e.g. a local Jaeger: dsv4_devcluster.jaeger), beside the untraced one",
    )
    return p


def print_span_cpu(args: argparse.Namespace) -> None:
    cost = span_cpu(args.otlp_traces_endpoint, args.span_cpu)
    print(
        json.dumps(cost)
        if args.json
        else f"tracing CPU per request ({args.span_cpu} requests, 3 spans each): "
        f"{cost['request_path_us']:.1f} us on the request path, "
        f"{cost['with_export_us']:.1f} us with the export"
    )


Paths = dict[str, tuple[Any, str]]


class Services:
    """The processes of one run, stopped in reverse order."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.all: list[Service] = []

    def start(self, name: str, argv: list[str], port: int) -> str:
        service = Service(name, argv, self.logs / f"{name}.log", f"http://127.0.0.1:{port}")
        self.all.append(service)
        service.start()
        return service.url

    def stop(self) -> None:
        for service in reversed(self.all):
            service.stop()


def start_paths(args: argparse.Namespace, services: Services) -> Paths:
    """Four stubs, the gateway (and a traced one), vllm-router: the paths to measure."""
    start = services.start
    names = ("p0", "p1", "d0", "d1", "gateway", "gateway-traced", "router")
    ports = {name: free_port() for name in names}
    stubs = {
        name: start(name, [sys.executable, str(STUB), "--port", str(ports[name])], ports[name])
        for name in ("p0", "p1", "d0", "d1")
    }
    prefills, decodes = [stubs["p0"], stubs["p1"]], [stubs["d0"], stubs["d1"]]
    upstreams = [
        *(a for u in prefills for a in ("--prefill", u)),
        *(a for u in decodes for a in ("--decode", u)),
    ]
    gw_argv = dsv4_argv("gateway", "--port", str(ports["gateway"]), "--log-level", "warning")
    gateway_url = start("gateway", [*gw_argv, *upstreams], ports["gateway"])
    traced_url = None
    if args.otlp_traces_endpoint:
        tr_argv = dsv4_argv(
            "gateway", "--port", str(ports["gateway-traced"]), "--log-level", "warning"
        )
        tr_argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint, *upstreams]
        traced_url = start("gateway-traced", tr_argv, ports["gateway-traced"])
    router = ensure_vllm_router()
    router_url = None
    if router:
        argv = router_argv(router, prefills, decodes, ports["router"])
        router_url = start("vllm-router", argv, ports["router"])
    for service in services.all:
        service.wait_ready(60)
    paths: dict[str, tuple[Any, str]] = {
        "direct (client does P then D)": (direct(prefills, decodes), ""),
        "dsv4 gateway": (via_router, gateway_url),
    }
    if traced_url:
        paths["dsv4 gateway, tracing on"] = (via_router, traced_url)
    if router_url:
        paths[f"vllm-router {ROUTER_VERSION}"] = (via_router, router_url)
    return paths


def measure_rounds(args: argparse.Namespace, paths: Paths) -> dict[str, dict[str, float]]:
    # interleave the paths round by round and keep the median: this machine's noise (other
    # processes, 2 cores) moves single runs by more than the differences being measured
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, (call, base_url) in paths.items():
            runs[name].append(asyncio.run(measure(call, base_url, args.requests, args.concurrency)))
    return {
        name: {k: statistics.median(r[k] for r in rs) for k in ("p50", "p99", "rps")}
        | {"errors": sum(r["errors"] for r in rs)}
        for name, rs in runs.items()
    }


def print_rows(args: argparse.Namespace, rows: dict[str, dict[str, float]]) -> None:
    base = rows["direct (client does P then D)"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"\nGateway overhead, PD requests (prefill + decode, 16 tokens), fast upstreams on 127.0.0.1, {os.cpu_count()} CPUs, median of {args.rounds} interleaved rounds\n"
    )
    print(
        f"{'path':<32}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'added p99':>11}{'req/s':>9}{'errors':>8}"
    )
    for name, r in rows.items():
        print(
            f"{name:<32}{r['p50'] * 1e3:>9.2f}{r['p99'] * 1e3:>9.2f}{(r['p50'] - base['p50']) * 1e3:>11.2f}{(r['p99'] - base['p99']) * 1e3:>11.2f}{r['rps']:>9.0f}{r['errors']:>8.0f}"
        )
    ours = rows["dsv4 gateway"]
    theirs = next((v for k, v in rows.items() if k.startswith("vllm-router")), None)
    if theirs:
        # p50 as measured, not as added to the direct path: that difference is often within noise
        # (or below zero), where a ratio of it means nothing
        print(
            f"\ndsv4/vllm-router: throughput {ours['rps'] / theirs['rps']:.2f}x, p50 {ours['p50'] / theirs['p50']:.2f}x "
            f"(goal: throughput >= 1, p50 <= 1)"
        )


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.requests < 10 or args.concurrency < 1 or args.rounds < 1:
        p.error("--requests must be >= 10, --concurrency and --rounds >= 1")
    if args.span_cpu is not None:
        if not args.otlp_traces_endpoint or args.span_cpu < 1:
            p.error("--span-cpu N needs N >= 1 and --otlp-traces-endpoint")
        print_span_cpu(args)
        return 0
    services = Services(Path(os.environ.get("TMPDIR", "/tmp")) / f"dsv4-gw-bench-{os.getpid()}")
    try:
        paths = start_paths(args, services)
        rows = measure_rounds(args, paths)
    finally:
        services.stop()
    print_rows(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
