"""What the engine's host work costs per step, and what engines sharing a host cost each other.

1. EMULATED steps (``--emulate-step-time 10,0,0``, dsv4-tiny): a device step of fixed length,
   so the achieved step rate against the ideal one is the host's overhead, independent of the
   CPU's speed. For each ``--scheduling`` mode (``--async-scheduling off``: synchronous, ``on``:
   async) and each ``--mtp`` value (``--num-speculative-tokens``; the emulated drafts are
   always accepted, so a step makes k + 1 tokens), and for each batch size N, N concurrent
   non-streamed requests of ``--output-len`` tokens from one asyncio client over raw
   keep-alive HTTP/1.1 connections, opened before the clock starts (the client shares the
   host's cores: an ``httpx`` client cost more CPU than the engine's front end). The ideal wall time
   is ``1 + ceil((output_len - 1) / (k + 1))`` steps (the prompt's step makes the first token,
   then each step k + 1: 200 steps for 200 tokens without MTP; figures before this benchmark
   counted 201). Reported: achieved / ideal step rate, host milliseconds per step (wall /
   ideal steps - step), the steps the engine ran (more than ideal when the admissions spread
   over several steps), the steps it ran per second against 1 / step (the share of the wall
   time the emulated device was busy), and the engine's own spans per step (``GET /debug/host_times``, reset before each run): schedule, prepare, post-process and
   stream, p50 / p99 in ms. Under async scheduling schedule, prepare and post-process overlap
   the device step; what is not hidden shows in the achieved rate.
2. ``dsv4 up --decode 2`` (three engines, their sidecars and the gateway on this host) under
   ``dsv4 bench --input-len 200 --output-len 64`` at concurrency 1 and 16, once per
   ``--cpu-budget`` (default ``auto`` and ``off``: the budget and its side-by-side anchor).

Prints the tables, writes them as JSON (``--json``) and a chart of achieved / ideal against
running sequences (``--chart``).

    .venv/bin/python benchmarks/host_overhead.py [--sizes 1,16,64,128,256] [--mtp 0,3]
        [--scheduling off,on] [--budgets auto,off]
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

from charts import line_chart

from dsv4_common.process import Service, dsv4_argv, free_port

PHASES = ("schedule", "prepare", "post_process", "stream")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--sizes", type=ints, default=[1, 16, 64, 128, 256], help="running sequences")
    p.add_argument("--output-len", type=int, default=200, help="tokens per request (emulated)")
    p.add_argument("--step-ms", type=float, default=10.0, help="emulated device step (ms)")
    p.add_argument(
        "--scheduling",
        default="off,on",
        help="engine --async-scheduling values for the emulated runs, side by side",
    )
    p.add_argument("--mtp", type=ints, default=[0, 3], help="--num-speculative-tokens values")
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


def emulated_engine(args: argparse.Namespace, log_dir: Path, scheduling: str, k: int) -> Service:
    port = free_port()
    seqs = max(args.sizes)
    argv = dsv4_argv(
        "engine",
        *("--model", "dsv4-tiny", "--load-format", "dummy", "--host", "127.0.0.1"),
        *("--port", str(port), "--emulate-step-time", f"{args.step_ms:g},0,0"),
        *("--num-speculative-tokens", str(k), "--max-num-seqs", str(seqs)),
        *("--max-model-len", str(args.output_len + 64), "--log-level", "WARNING"),
        *("--async-scheduling", scheduling),
    )
    log = log_dir / f"emulated-{scheduling}-mtp{k}-{port}.log"
    return Service("emulated", argv, log, f"http://127.0.0.1:{port}")


class Connection:
    """One keep-alive HTTP/1.1 connection with nothing but what these requests need: the
    client shares the host's cores with the engine, and an ``httpx`` client spent more CPU
    per request than the engine's front end (at 256 requests, its sends spread the
    admissions over many steps, and its parsing of the answers ends the run late)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Connection:
        host, port = url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def request(self, head: bytes, body: bytes = b"") -> Any:
        """Send a request (its head and body, prepared by ``http_request``); -> its JSON."""
        self.writer.write(head + body)
        status = await self.reader.readuntil(b"\r\n\r\n")
        lines = status.decode("latin-1").split("\r\n")
        length = next(
            int(line.split(":", 1)[1])
            for line in lines
            if line.lower().startswith("content-length:")
        )
        payload = await self.reader.readexactly(length)
        code = int(lines[0].split()[1])
        if code != 200:
            raise RuntimeError(f"HTTP {code}: {payload[:200]!r}")
        return json.loads(payload)

    def close(self) -> None:
        self.writer.close()


def http_request(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def timed_run(url: str, n: int, output_len: int) -> tuple[float, dict[str, Any]]:
    """Seconds for ``n`` concurrent non-streamed requests of ``output_len`` tokens, and the
    engine's host spans over them. The connections are open before the clock starts."""
    body = {"model": "dsv4-tiny", "prompt": "hello world", "max_tokens": output_len}
    post = http_request("POST", "/v1/completions", json.dumps(body).encode())
    conns = [await Connection.open(url) for _ in range(n)]
    try:

        async def one(conn: Connection) -> None:
            got = (await conn.request(post))["usage"]["completion_tokens"]
            if got != output_len:
                raise RuntimeError(f"asked {output_len} tokens, got {got}")

        await one(conns[0])  # warm the code paths
        await conns[0].request(http_request("GET", "/debug/host_times?reset=true"))
        t = time.perf_counter()
        await asyncio.gather(*(one(c) for c in conns))
        wall = time.perf_counter() - t
        spans = await conns[0].request(http_request("GET", "/debug/host_times"))
        return wall, spans
    finally:
        for c in conns:
            c.close()


def ideal_steps(output_len: int, k: int) -> int:
    """The prompt's step (its first token), then k + 1 tokens a step."""
    return 1 + -(-(output_len - 1) // (k + 1))


def overhead_row(
    n: int, wall_s: float, output_len: int, step_ms: float, k: int, spans: dict[str, Any]
) -> dict[str, float]:
    steps = ideal_steps(output_len, k)
    ideal_s = steps * step_ms / 1e3
    row = {
        "running_sequences": n,
        "wall_s": wall_s,
        "achieved_over_ideal": ideal_s / wall_s,
        "host_ms_per_step": max(0.0, wall_s * 1e3 / steps - step_ms),
        "steps_run": float(spans.get("schedule", {}).get("count", 0)),
    }
    # the steps the engine ran per second against 1 / step: the device's idle share, apart
    # from the steps the admissions' spread added (each counted in achieved / ideal)
    row["step_rate_over_ideal"] = row["steps_run"] * step_ms / 1e3 / wall_s
    for phase in PHASES:
        got = spans.get(phase, {})
        row[f"{phase}_p50_ms"] = float(got.get("p50_ms", 0.0))
        row[f"{phase}_p99_ms"] = float(got.get("p99_ms", 0.0))
    return row


def run_emulated(
    args: argparse.Namespace, log_dir: Path, scheduling: str, k: int
) -> list[dict[str, float]]:
    engine = emulated_engine(args, log_dir, scheduling, k)
    engine.start(env={"PYTHONUNBUFFERED": "1"})
    try:
        try:
            engine.wait_ready(args.startup_timeout)
        except RuntimeError as exc:  # e.g. async scheduling refused with MTP: say so, go on
            print(f"  --async-scheduling {scheduling} with MTP {k} did not start: {exc}")
            return []
        rows = []
        for n in args.sizes:
            wall, spans = asyncio.run(timed_run(engine.url, n, args.output_len))
            rows.append(overhead_row(n, wall, args.output_len, args.step_ms, k, spans))
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
    def line(name: str, fmt: str, key: str) -> str:
        return f"| {name} | " + " | ".join(fmt.format(r[key]) for r in rows) + " |"

    lines = [
        "| running sequences | "
        + " | ".join(str(int(r["running_sequences"])) for r in rows)
        + " |",
        "|---|" + "---|" * len(rows),
        line("achieved / ideal step rate", "{:.2f}", "achieved_over_ideal"),
        line("host time per step (ms)", "{:.1f}", "host_ms_per_step"),
        line("steps run (ideal + admission spread)", "{:.0f}", "steps_run"),
        line("steps run per s / ideal (device busy share)", "{:.2f}", "step_rate_over_ideal"),
    ]
    for phase in PHASES:  # p50 / p99 in one cell
        cells = " | ".join(f"{r[f'{phase}_p50_ms']:.2f} / {r[f'{phase}_p99_ms']:.2f}" for r in rows)
        lines.append(f"| {phase.replace('_', '-')} p50 / p99 (ms) | {cells} |")
    return "\n".join(lines)


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


def chart(runs: dict[str, list[dict[str, float]]], path: Path, step_ms: float) -> str:
    series = {
        name: [(r["running_sequences"], r["achieved_over_ideal"]) for r in rows]
        for name, rows in runs.items()
        if rows
    }
    title = f"EMULATED {step_ms:g} ms steps, dsv4-tiny: host overhead"
    line_chart(path, title, "running sequences", "achieved / ideal step rate", series)
    return f"chart: {path}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="dsv4-host-overhead-"))
    print(f"logs in {log_dir}", flush=True)
    emulated: dict[str, list[dict[str, float]]] = {}
    if not args.skip_emulated:
        for k in args.mtp:
            for mode in [m for m in args.scheduling.split(",") if m]:
                name = f"--async-scheduling {mode}, MTP {k}"
                print(name, flush=True)
                emulated[name] = run_emulated(args, log_dir, mode, k)
        for name, rows in emulated.items():
            if rows:
                print(f"\nEMULATED {args.step_ms:g} ms steps, {args.output_len} tokens, {name}\n")
                print(overhead_table(rows))
        print(chart(emulated, args.chart, args.step_ms))
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
