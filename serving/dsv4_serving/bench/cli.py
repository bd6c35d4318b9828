"""``dsv4 bench``: load an OpenAI-compatible server and report TTFT, TPOT, ITL, E2E, throughput
and goodput."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any


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


class _BadArgs(Exception):
    """A flag's value cannot run: the message names the flag."""


def _fail(msg: str) -> int:
    print(f"dsv4 bench: error: {msg}", file=sys.stderr)
    return 2


def _check_ranges(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--num-requests", args.num_requests),
        ("--input-len", args.input_len),
        ("--output-len", args.output_len),
    ):
        if value < 1:
            raise _BadArgs(f"{flag} must be >= 1, got {value}")
    if args.concurrency is not None and args.concurrency < 1:
        raise _BadArgs(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.request_rate is not None and args.request_rate <= 0:
        raise _BadArgs(f"--request-rate must be > 0, got {args.request_rate}")
    if not 0 <= args.input_range < 1:
        raise _BadArgs(f"--input-range must be in [0, 1), got {args.input_range}")


def _schedule(args: argparse.Namespace) -> tuple[list[Any], list[Any]] | None:
    """The --schedule phases and arrival times (None without it); sets --num-requests to fit."""
    if args.schedule is None:
        return None
    from dsv4_serving.bench.schedule import ScheduleError, arrivals, parse_schedule

    try:
        phases = parse_schedule(args.schedule)
        times = arrivals(phases, args.seed)
    except ScheduleError as e:
        raise _BadArgs(str(e)) from e
    if not times:
        raise _BadArgs("--schedule produces no request (every rate is 0)")
    args.num_requests = len(times)
    return phases, times


def _model_name(args: argparse.Namespace, base: str, headers: dict[str, str]) -> str:
    if args.model is not None:
        return str(args.model)
    import httpx

    try:
        r = httpx.get(f"{base}/v1/models", headers=headers, timeout=10)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise _BadArgs(f"--model not given and {base}/v1/models did not name one: {e}") from e


def _prompts(args: argparse.Namespace, model: str) -> list[Any]:
    from dsv4_serving.bench.client import jsonl_prompts, random_prompts

    chat = args.endpoint == "chat"
    try:
        if args.dataset:
            return jsonl_prompts(args.dataset, args.num_requests, args.output_len, chat, model)
        return random_prompts(
            args.num_requests,
            args.input_len,
            args.input_range,
            args.output_len,
            args.seed,
            chat,
            model,
        )
    except (OSError, ValueError) as e:
        raise _BadArgs(f"--dataset: {e}") from e


def run(args: argparse.Namespace) -> int:
    from dsv4_serving.bench.client import run_load
    from dsv4_serving.bench.stats import format_table, phase_summaries, summarize, write_records

    base = args.url.rstrip("/")
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        _check_ranges(args)
        planned = _schedule(args)
        model = _model_name(args, base, headers)
        prompts = _prompts(args, model)
    except _BadArgs as e:
        return _fail(str(e))
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    show_progress = not args.no_progress and not args.json
    schedule = planned[1] if planned else None
    records, wall = asyncio.run(
        run_load(
            base + path,
            prompts,
            headers,
            args.concurrency,
            args.request_rate,
            args.seed,
            args.timeout,
            show_progress,
            schedule,
        )
    )
    summary = summarize(records, wall, args.ttft_slo, args.tpot_slo)
    if planned is not None:
        summary["phases"] = phase_summaries(records, planned[0], args.ttft_slo, args.tpot_slo)
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
