"""Prefix routing, four ways, side by side in one run: the multi-turn sessions of
``sessions.py`` (imported: the same chats, turns in lockstep, the same accounting) through a
``dsv4 up`` PD stack (``--prefill 2 --decode 2`` by default) this script starts once per
variant, every variant with the same seeds, sizes and stack:

  (a) round_robin  the gateway's ``--policy round_robin``: no prefix affinity at all;
  (b) estimate     ``dplb`` with the gateway's estimate of what it routed where (no events);
  (c) precise      the engines publish KV events, the gateway scores their exact cached
                   prefixes (``--kv-events``), pulls off;
  (d) pulls        (c) plus every sidecar's host tier (``--kv-host-bytes``) and the gateway's
                   prefix pulls: turn t's prefill pulls turn t-1's answer (decoded elsewhere)
                   and whatever another instance holds instead of computing it.

The workload is an agent session (``sessions.AGENT_SESSION``, the defaults): a shared system
prompt, then per turn a short new message after a long answer, so what (a)-(c) recompute each
turn is mostly the previous answer (8x the new message), as in a V4 agent's sessions. Its 6
turns reach ~3.3K of dsv4-tiny's 4,096 positions: more turns need shorter answers.

Reusable tokens are the whole history before the new message, the previous answer included
(``sessions.reusable_tokens`` in its colocated sense): in PD only a pull can reuse the answer,
which is what (d) adds. Reused tokens are the prefill answers' ``cached_tokens`` (local hits
and pulled tokens alike), which the gateway sums in ``dsv4_gateway_actual_cached_tokens_total``.

Per variant: reused / reusable over turns 2..T, and TTFT p50 / p90 over every request of turns
2..T (streamed). Goals (issue 31): (d) reuses >= 95% of the reusable tokens, and its TTFT p90
<= 0.5 x (b)'s. A JSON file and two PNGs (TTFT p50 and p90 per turn, one line per variant) go
to ``--out``. ``--trace`` also traces every request into a local Jaeger and prints, per turn
and variant, where the TTFT went (``ttft_stages``: routing, the prefill's queue, the prefix
pull, its compute, the export, the decode's KV pull and first step); tracing costs time in
every component, so figures for the goals come from a run without it. The engines run
without MTP (``--num-speculative-tokens=0``), in every variant alike.

    .venv/bin/python benchmarks/prefix_routing.py --sessions 8
    .venv/bin/python benchmarks/prefix_routing.py --sessions 2 --turns 3 --output-len 96 \\
        --variants b,d --trace
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import sessions
import ttft_stages
from charts import line_chart

from dsv4_common.process import Service, free_ports, metric_value
from dsv4_serving.bench.stats import percentile

VARIANTS = {
    "a": "round_robin",
    "b": "estimate",
    "c": "precise",
    "d": "pulls",
}
QUERIES = sessions.QUERIES
ACTUAL_CACHED = "dsv4_gateway_actual_cached_tokens_total"
GATEWAY_PULLS = "dsv4_gateway_prefix_pulls_total"
PULL_OUTCOMES = ("attached", "declined", "loaded", "computed")
ENGINE_ARGS = ["--num-speculative-tokens=0"]


def variant_flags(variant: str, host_bytes: str) -> dict[str, list[str]]:
    """Extra flags per process kind for ``variant``; ``events``: the engines publish KV
    events (each its own port, which ``configure`` picks)."""
    gateway = {
        "a": ["--policy", "round_robin"],
        "b": [],
        "c": ["--prefix-pulls", "off"],
        "d": ["--prefix-pulls", "on"],
    }[variant]
    return {
        "gateway": gateway,
        "sidecar": ["--kv-host-bytes", host_bytes] if variant == "d" else [],
        "events": ["on"] if variant in ("c", "d") else [],
    }


def _ports(children: list[Service]) -> set[int]:
    """Every port the plan handed out, and the three after each (a sidecar's)."""
    out: set[int] = set()
    for c in children:
        for a in c.argv:
            for m in re.findall(r"(?<![\d.])(\d{4,5})(?!\d)", a):
                out.update(range(int(m), int(m) + 4))
    return out


def configure(children: list[Service], variant: str, host_bytes: str) -> None:
    """Add the variant's flags to ``dsv4 up``'s plan (sidecars, engines, gateway last)."""
    flags = variant_flags(variant, host_bytes)
    gateway = children[-1]
    taken = _ports(children)
    for c in children[:-1]:
        if c.name.endswith("sidecar"):
            c.argv = [*c.argv, *flags["sidecar"]]
        elif flags["events"]:
            endpoint = f"tcp://127.0.0.1:{free_ports(2, taken)}"  # publisher and replay
            c.argv = [*c.argv, "--kv-events-endpoint", endpoint]
            gateway.argv = [*gateway.argv, "--kv-events", f"{c.url}={endpoint}"]
    gateway.argv = [*gateway.argv, *flags["gateway"]]


def reuse_scraper(gateway: Service) -> Callable[[list[Service]], Awaitable[tuple[float, float]]]:
    """``sessions.scrape`` for PD: the engines' prefix-cache queries, and as hits the cached
    tokens of the prefill answers (the gateway's ``actual_cached_tokens``), which count a
    pulled prefix too (the engines' hit counter has only local hits, and none of a request
    that pulled)."""

    async def scrape(engines: list[Service]) -> tuple[float, float]:
        queried = 0.0
        async with httpx.AsyncClient(timeout=10) as client:
            for e in engines:
                queried += metric_value((await client.get(f"{e.url}/metrics")).text, QUERIES)
            text = (await client.get(f"{gateway.url}/metrics")).text
        return queried, metric_value(text, ACTUAL_CACHED)

    return scrape


def run_variant(
    variant: str, args: argparse.Namespace, run_dir: Path, jaeger_url: str | None = None
) -> list[dict[str, Any]]:
    from dsv4_serving.commands import up

    stack = sessions.stack_args("pd", args, run_dir / variant)
    stack.log_dir.mkdir(parents=True, exist_ok=True)
    if args.otlp_endpoint:
        stack.otlp_traces_endpoint = args.otlp_endpoint
    up.check_counts(stack)
    children = up.plan(stack, stack.log_dir)
    configure(children, variant, args.host_bytes)
    gateway = children[-1]
    engines = [c for c in children if c is not gateway and not c.name.endswith("sidecar")]
    print(f"({variant}) {VARIANTS[variant]}: logs in {stack.log_dir}", flush=True)
    # sessions' per-turn lines say "colocated": its accounting counts the previous answer
    sessions.scrape = reuse_scraper(gateway)
    try:
        up.start_in_order(children, stack.startup_timeout)
        model = Path(args.model).name
        rows = asyncio.run(sessions.run_sessions("colocated", gateway.url, model, args, engines))
        text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        pulls = {o: metric_value(text, GATEWAY_PULLS, outcome=o) for o in PULL_OUTCOMES}
        print(f"({variant}) the gateway's prefix pulls: {pulls}", flush=True)
        if rows:
            rows[-1]["prefix_pulls"] = pulls
        if jaeger_url is not None:
            add_stages(rows, jaeger_url)
        return rows
    finally:
        for c in reversed(children):
            c.stop(timeout_s=15.0)


def add_stages(rows: list[dict[str, Any]], jaeger_url: str) -> None:
    """Each turn's requests' TTFT stages from their traces (``ttft_stages``): one entry per
    whole PD trace of the turn's window, and the turn's mean."""
    for r in rows:
        try:
            found = ttft_stages.window_stages(jaeger_url, *r["window_unix_s"])
        except (OSError, ValueError) as e:  # the figures stand without the breakdown
            print(f"  turn {r['turn']}: no traces from {jaeger_url}: {e}", flush=True)
            found = []
        r["stages_ms"] = found
        r["stages_mean_ms"] = ttft_stages.mean_stages(found)
        mean = r["stages_mean_ms"]
        if mean is not None:
            print(f"  turn {r['turn']}: {format_stages(mean)} ({len(found)} traces)", flush=True)


def format_stages(mean: dict[str, float]) -> str:
    return ", ".join(f"{k} {mean[k]:.0f}" for k in (*ttft_stages.STAGES, "ttft")) + " ms"


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Reused / reusable and TTFT p50 / p90 over turns 2..T (all turns if there is one)."""
    later = [r for r in rows if r["turn"] > 1] or rows
    reusable = sum(r["reusable_tokens"] for r in later)
    hits = sum(r["hit_tokens"] for r in later)
    ttfts = [s["ttft"] for r in later for s in r["per_session"] if s["ok"]]
    return {
        "reusable_tokens": reusable,
        "reused_tokens": hits,
        "hit_ratio": hits / reusable if reusable else None,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
        "failed": sum(r["failed"] for r in rows),
        "prefix_pulls": rows[-1].get("prefix_pulls") if rows else None,
        "stages_mean_ms": ttft_stages.mean_stages(
            [x for r in later for x in r.get("stages_ms") or []]
        ),
    }


def turn_p90(row: dict[str, Any]) -> float | None:
    ttfts = [s["ttft"] for s in row["per_session"] if s["ok"]]
    return percentile(ttfts, 90) if ttfts else None


def goals(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    d, b = summaries.get("d"), summaries.get("b")
    if d is not None:
        ratio = d["hit_ratio"]
        out["pulls_hit_ratio"] = {
            "value": ratio,
            "goal": ">= 0.95",
            "pass": ratio is not None and ratio >= 0.95,
        }
    if d is not None and b is not None and d["ttft_p90_s"] and b["ttft_p90_s"]:
        rel = d["ttft_p90_s"] / b["ttft_p90_s"]
        out["pulls_ttft_p90_vs_estimate"] = {"value": rel, "goal": "<= 0.5", "pass": rel <= 0.5}
    return out


def format_summaries(summaries: dict[str, dict[str, Any]]) -> str:
    f = sessions._f
    lines = [f"{'variant':<16} {'reused/reusable':>22} {'ratio':>6} {'p50 ms':>8} {'p90 ms':>8}"]
    for v, s in summaries.items():
        p50 = None if s["ttft_p50_s"] is None else s["ttft_p50_s"] * 1000
        p90 = None if s["ttft_p90_s"] is None else s["ttft_p90_s"] * 1000
        lines.append(
            f"({v}) {VARIANTS[v]:<12} {s['reused_tokens']:>10} / {s['reusable_tokens']:<9} "
            f"{f(s['hit_ratio'], '.3f'):>6} {f(p50, '.0f'):>8} {f(p90, '.0f'):>8}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default="a,b,c,d", help="of a, b, c, d (default all)")
    agent = sessions.AGENT_SESSION
    p.add_argument("--sessions", type=int, default=8, help="concurrent sessions (default 8)")
    p.add_argument("--turns", type=int, default=agent["turns"], help="turns per session")
    p.add_argument(
        "--system-len", type=int, default=agent["system_len"], help="system prompt words (shared)"
    )
    p.add_argument(
        "--user-len", type=int, default=agent["user_len"], help="words per new user message"
    )
    p.add_argument(
        "--output-len", type=int, default=agent["output_len"], help="answer tokens (ignore_eos)"
    )
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    p.add_argument("--duration", type=float, default=1800.0, help="most seconds per variant")
    p.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    p.add_argument("--thinking", action="store_true", help="thinking on (history drops it)")
    p.add_argument("--free-answers", action="store_true", help="see sessions.py")
    p.add_argument("--prefill", type=int, default=2, help="prefill engines (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode engines (default 2)")
    p.add_argument("--host-bytes", default="256M", help="(d): each sidecar's --kv-host-bytes")
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace every request (a local Jaeger) and print where each turn's TTFT went",
    )
    p.add_argument(
        "--engine-arg", action="append", default=[], help=f"to every engine, after {ENGINE_ARGS}"
    )
    p.add_argument("--model", default="dsv4-tiny", help="a DeepSeek-format preset or checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seeds the messages")
    p.add_argument("--out", type=Path, default=Path("prefix-routing-out"), help="JSON, PNG, logs")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"--variants: {bad or 'none'} not in {', '.join(VARIANTS)}")
    for flag in ("sessions", "turns", "user_len", "output_len", "prefill", "decode"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    args.engine_arg = [*ENGINE_ARGS, *args.engine_arg]
    args.engines = args.decode  # sessions.stack_args reads it for its colocated shape only
    return args


def run_all(args: argparse.Namespace, run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every variant in turn; with ``--trace``, one Jaeger for all of them."""
    if not args.trace:
        args.otlp_endpoint = None
        return {v: run_variant(v, args, run_dir) for v in args.variants}
    from dsv4_devcluster.jaeger import Jaeger, binary

    with Jaeger.start(binary(), run_dir) as jaeger:
        args.otlp_endpoint = jaeger.otlp_endpoint
        return {v: run_variant(v, args, run_dir, jaeger.query_url) for v in args.variants}


def write_charts(out: Path, results: dict[str, list[dict[str, Any]]]) -> list[Path]:
    """TTFT p50 and p90 per turn, one line per variant."""
    paths = []
    for stat, of in (("p50", lambda r: r["ttft_p50_s"]), ("p90", turn_p90)):
        series = {
            f"({v}) {VARIANTS[v]}": [(r["turn"], of(r)) for r in rows]
            for v, rows in results.items()
        }
        paths.append(
            line_chart(
                out / f"prefix-routing-ttft-{stat}.png",
                f"TTFT {stat} per turn",
                "turn",
                "seconds",
                series,
            )
        )
    return paths


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="logs-", dir=args.out))
    results = run_all(args, run_dir)
    summaries = {v: summary(rows) for v, rows in results.items() if rows}
    checks = goals(summaries)
    print("\n== prefix routing: turns 2.. (reused = the prefill answers' cached tokens) ==")
    print(format_summaries(summaries))
    for v, s in summaries.items():
        if s["stages_mean_ms"] is not None:
            print(f"({v}) TTFT stages (mean): {format_stages(s['stages_mean_ms'])}")
    for name, g in checks.items():
        print(
            f"{name}: {sessions._f(g['value'], '.3f')} goal {g['goal']}: "
            f"{'PASS' if g['pass'] else 'FAIL'}"
        )
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out = {"config": config, "variants": results, "summaries": summaries, "goals": checks}
    (args.out / "prefix_routing.json").write_text(json.dumps(out, indent=2))
    pngs = write_charts(args.out, results)
    print(
        f"\nwrote {args.out / 'prefix_routing.json'}, {', '.join(map(str, pngs))}; logs in {run_dir}"
    )
    return 1 if any(s["failed"] for s in summaries.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
