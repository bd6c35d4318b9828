"""``dsv4 bench``: load an OpenAI-compatible server and report TTFT, TPOT, ITL, E2E, throughput
and goodput."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server base URL (gateway or engine)"
    )
    p.add_argument(
        "--model",
        required=False,
        default=None,
        help="model name (default: the server's first /v1/models entry)",
    )
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="/v1/completions or /v1/chat/completions (default: completions)",
    )
    p.add_argument(
        "--num-requests", type=int, default=64, help="requests to send in all (default: 64)"
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=int, default=None, help="fixed number of requests in flight"
    )
    load.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals per second"
    )
    load.add_argument(
        "--schedule",
        default=None,
        metavar="STEPS",
        help='request-rate steps, e.g. "60s@0.5,120s@4,90s@0.5" (Poisson within each; the '
        "number of requests follows from it); the summary is given per phase too",
    )
    p.add_argument(
        "--records",
        type=Path,
        default=None,
        metavar="FILE",
        help="write one JSON line per request: send time, phase, TTFT, E2E, tokens, error",
    )
    p.add_argument("--input-len", type=int, default=256, help="prompt length (words ~ tokens)")
    p.add_argument(
        "--input-range", type=float, default=0.0, help="prompt length spread, as a fraction"
    )
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (with ignore_eos)")
    p.add_argument(
        "--dataset", type=Path, default=None, help='JSONL of {"prompt": ..., "max_tokens"?}'
    )
    p.add_argument("--ttft-slo", type=float, default=None, help="goodput: TTFT objective (s)")
    p.add_argument("--tpot-slo", type=float, default=None, help="goodput: TPOT objective (s)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    p.add_argument(
        "--seed", type=int, default=0, help="random prompts and arrival times (default: 0)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _fail(msg: str) -> int:
    print(f"dsv4 bench: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import httpx

    from dsv4_serving.bench.client import jsonl_prompts, random_prompts, run_load
    from dsv4_serving.bench.stats import (
        format_table,
        phase_summaries,
        summarize,
        write_records,
    )

    for flag, value, lo in (
        ("--num-requests", args.num_requests, 1),
        ("--input-len", args.input_len, 1),
        ("--output-len", args.output_len, 1),
    ):
        if value < lo:
            return _fail(f"{flag} must be >= {lo}, got {value}")
    if args.concurrency is not None and args.concurrency < 1:
        return _fail(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.request_rate is not None and args.request_rate <= 0:
        return _fail(f"--request-rate must be > 0, got {args.request_rate}")
    if not 0 <= args.input_range < 1:
        return _fail(f"--input-range must be in [0, 1), got {args.input_range}")
    schedule = None
    if args.schedule is not None:
        from dsv4_serving.bench.schedule import ScheduleError, arrivals, parse_schedule

        try:
            phases = parse_schedule(args.schedule)
            schedule = arrivals(phases, args.seed)
        except ScheduleError as e:
            return _fail(str(e))
        if not schedule:
            return _fail("--schedule produces no request (every rate is 0)")
        args.num_requests = len(schedule)
    base = args.url.rstrip("/")
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        try:
            r = httpx.get(f"{base}/v1/models", headers=headers, timeout=10)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            return _fail(f"--model not given and {base}/v1/models did not name one: {e}")
    chat = args.endpoint == "chat"
    try:
        if args.dataset:
            prompts = jsonl_prompts(args.dataset, args.num_requests, args.output_len, chat, model)
        else:
            prompts = random_prompts(
                args.num_requests,
                args.input_len,
                args.input_range,
                args.output_len,
                args.seed,
                chat,
                model,
            )
    except (OSError, ValueError) as e:
        return _fail(f"--dataset: {e}")
    url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
    records, wall = asyncio.run(
        run_load(
            url,
            prompts,
            headers,
            args.concurrency,
            args.request_rate,
            args.seed,
            args.timeout,
            not args.no_progress and not args.json,
            schedule,
        )
    )
    summary = summarize(records, wall, args.ttft_slo, args.tpot_slo)
    if schedule is not None:
        summary["phases"] = phase_summaries(records, phases, args.ttft_slo, args.tpot_slo)
    if args.records is not None:
        write_records(args.records, records)
    summary["config"] = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if not k.startswith("_") and k != "api_key"
    }
    summary["config"]["model"] = model
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    return 0 if summary["completed"] else 1
