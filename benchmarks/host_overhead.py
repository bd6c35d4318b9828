"""What the engine's host work costs per step, and what engines sharing a host cost each other.

1. EMULATED steps (``--emulate-step-time 10,0,0 --num-speculative-tokens 0``, dsv4-tiny): a device
   step of fixed length, so the achieved step rate against the ideal one is the host's overhead,
   independent of the CPU's speed. For each batch size N, N concurrent non-streamed requests of
   ``--output-len`` tokens from one async client; the ideal wall time is (output_len + 1) steps
   (the prompt's step, then one per token; the same count as the measurements page's figures).
   Reported: achieved / ideal step rate, and host milliseconds per step (wall / steps - step).
2. ``dsv4 up --decode 2`` (three engines, their sidecars and the gateway on this host) under
   ``dsv4 bench --input-len 200 --output-len 64`` at concurrency 1 and 16, once per
   ``--cpu-budget`` (default ``auto`` and ``off``: the budget and its side-by-side anchor).

Prints both tables, writes them as JSON (``--json``) and a chart of achieved / ideal against
running sequences (``--chart``).

    .venv/bin/python benchmarks/host_overhead.py [--sizes 1,64,128,256] [--budgets auto,off]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from charts import line_chart

from dsv4_common.process import Service, dsv4_argv, free_port


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--sizes", type=ints, default=[1, 64, 128, 256], help="running sequences")
    p.add_argument("--output-len", type=int, default=200, help="tokens per request (emulated)")
    p.add_argument("--step-ms", type=float, default=10.0, help="emulated device step (ms)")
    p.add_argument(
        "--scheduling",
        default="off,on",
        help="engine --async-scheduling values for the emulated runs, side by side",
    )
    p.add_argument("--budgets", default="auto,off", help="dsv4 up --cpu-budget values ('' skips)")
    p.add_argument("--concurrency", type=ints, default=[1, 16], help="dsv4 bench concurrencies")
    p.add_argument("--stack-requests", type=int, default=64, help="dsv4 bench requests per run")
    p.add_argument("--stack-input-len", type=int, default=200)
    p.add_argument("--stack-output-len", type=int, default=64)
    p.add_argument("--skip-emulated", action="store_true", help="only the dsv4 up runs")
    p.add_argument("--chart", type=Path, default=Path("host_overhead.png"))
    p.add_argument("--json", type=Path, default=None, help="write both tables here")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    return p.parse_args(argv)


# ---- 1. EMULATED steps -----------------------------------------------------------------------


def emulated_engine(args: argparse.Namespace, log_dir: Path, scheduling: str) -> Service:
    port = free_port()
    seqs = max(args.sizes)
    argv = dsv4_argv(
        "engine",
        *("--model", "dsv4-tiny", "--load-format", "dummy", "--host", "127.0.0.1"),
        *("--port", str(port), "--emulate-step-time", f"{args.step_ms:g},0,0"),
        *("--num-speculative-tokens", "0", "--max-num-seqs", str(seqs)),
        *("--max-model-len", str(args.output_len + 64), "--log-level", "WARNING"),
        *("--async-scheduling", scheduling),
    )
    return Service("emulated", argv, log_dir / f"emulated-{port}.log", f"http://127.0.0.1:{port}")


async def wall_time(url: str, n: int, output_len: int) -> float:
    """Seconds for ``n`` concurrent non-streamed requests of ``output_len`` tokens."""
    body = {"model": "dsv4-tiny", "prompt": "hello world", "max_tokens": output_len}
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(limits=limits, timeout=3600) as client:

        async def one() -> None:
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            got = r.json()["usage"]["completion_tokens"]
            if got != output_len:
                raise RuntimeError(f"asked {output_len} tokens, got {got}")

        await one()  # warm the connection and the code paths
        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t


def overhead_row(n: int, wall_s: float, output_len: int, step_ms: float) -> dict[str, float]:
    steps = output_len + 1
    ideal_s = steps * step_ms / 1e3
    return {
        "running_sequences": n,
        "wall_s": wall_s,
        "achieved_over_ideal": ideal_s / wall_s,
        "host_ms_per_step": max(0.0, wall_s * 1e3 / steps - step_ms),
    }


def run_emulated(
    args: argparse.Namespace, log_dir: Path, scheduling: str
) -> list[dict[str, float]]:
    engine = emulated_engine(args, log_dir, scheduling)
    engine.start(env={"PYTHONUNBUFFERED": "1"})
    try:
        engine.wait_ready(args.startup_timeout)
        rows = []
        for n in args.sizes:
            wall = asyncio.run(wall_time(engine.url, n, args.output_len))
            rows.append(overhead_row(n, wall, args.output_len, args.step_ms))
            print(f"  {n} sequences: {wall:.2f} s", flush=True)
        return rows
    finally:
        engine.stop()


# ---- 2. dsv4 up --decode 2 -------------------------------------------------------------------


def up_stack(budget: str, log_dir: Path) -> Service:
    port = free_port()
    run_dir = log_dir / f"up-{budget}"
    argv = dsv4_argv(
        "up",
        *("--decode", "2", "--port", str(port), "--cpu-budget", budget),
        *("--log-dir", str(run_dir)),
    )
    return Service(f"up-{budget}", argv, log_dir / f"up-{budget}.log", f"http://127.0.0.1:{port}")


def bench(args: argparse.Namespace, url: str, concurrency: int) -> dict[str, Any]:
    argv = dsv4_argv(
        "bench",
        *("--url", url, "--concurrency", str(concurrency)),
        *("--num-requests", str(args.stack_requests), "--input-len", str(args.stack_input_len)),
        *("--output-len", str(args.stack_output_len), "--json", "--no-progress"),
    )
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=3600)
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary


def run_stack(args: argparse.Namespace, budget: str, log_dir: Path) -> list[dict[str, Any]]:
    stack = up_stack(budget, log_dir)
    stack.start(env={"PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + args.startup_timeout
        while "dsv4 is up" not in stack.tail(80):
            if not stack.running() or time.monotonic() > deadline:
                raise RuntimeError(f"dsv4 up --cpu-budget {budget} did not start:\n{stack.tail()}")
            time.sleep(0.5)
        rows = []
        for c in args.concurrency:
            s = bench(args, stack.url, c)
            rows.append(
                {
                    "cpu_budget": budget,
                    "concurrency": c,
                    "total_tok_s": s["total_token_throughput"],
                    "ttft_p50_s": s["ttft_s"]["p50"],
                    "tpot_p50_s": s["tpot_s"]["p50"],
                    "failed": s.get("failed", 0),
                }
            )
            print(f"  --cpu-budget {budget}, concurrency {c}: done", flush=True)
        return rows
    finally:
        stack.stop(timeout_s=60)


# ---- output ----------------------------------------------------------------------------------


def overhead_table(rows: list[dict[str, float]]) -> str:
    head = "| running sequences | " + " | ".join(str(int(r["running_sequences"])) for r in rows)
    rule = "|---|" + "---|" * len(rows)
    rate = "| achieved / ideal step rate | " + " | ".join(
        f"{r['achieved_over_ideal']:.2f}" for r in rows
    )
    host = "| host time per step (ms) | " + " | ".join(f"{r['host_ms_per_step']:.1f}" for r in rows)
    return "\n".join(f"{line} |" if line != rule else line for line in (head, rule, rate, host))


def stack_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| --cpu-budget | concurrency | total tok/s | TTFT p50 (s) | TPOT p50 (ms) | failed |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cpu_budget']} | {r['concurrency']} | {r['total_tok_s']:.1f} | "
            f"{r['ttft_p50_s']:.2f} | {r['tpot_p50_s'] * 1e3:.0f} | {r['failed']} |"
        )
    return "\n".join(lines)


def chart(runs: dict[str, list[dict[str, float]]], path: Path) -> str:
    series = {
        f"--async-scheduling {mode}": [
            (r["running_sequences"], r["achieved_over_ideal"]) for r in rows
        ]
        for mode, rows in runs.items()
    }
    title = "EMULATED 10 ms steps, dsv4-tiny: host overhead"
    line_chart(path, title, "running sequences", "achieved / ideal step rate", series)
    return f"chart: {path}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="dsv4-host-overhead-"))
    print(f"logs in {log_dir}", flush=True)
    emulated: dict[str, list[dict[str, float]]] = {}
    if not args.skip_emulated:
        for mode in [m for m in args.scheduling.split(",") if m]:
            emulated[mode] = run_emulated(args, log_dir, mode)
        for mode, rows in emulated.items():
            print(
                f"\nEMULATED {args.step_ms:g} ms steps, {args.output_len} tokens per request, "
                f"--async-scheduling {mode}\n"
            )
            print(overhead_table(rows))
        print(chart(emulated, args.chart))
    stack: list[dict[str, Any]] = []
    for budget in [b for b in args.budgets.split(",") if b]:
        stack += run_stack(args, budget, log_dir)
    if stack:
        print(
            f"\ndsv4 up --decode 2, dsv4 bench --input-len {args.stack_input_len} "
            f"--output-len {args.stack_output_len}\n"
        )
        print(stack_table(stack))
    if args.json:
        args.json.write_text(json.dumps({"emulated": emulated, "stack": stack}, indent=2))


if __name__ == "__main__":
    main()
