"""Multi-turn sessions: agent-like chats replayed through a ``dsv4 up`` stack this script starts
itself, colocated (``--no-pd --decode 2``) and PD (``--prefill 2``), side by side in one run.

Each session is a chat: a system prompt shared by all sessions, then per turn a new user message;
turn t's request carries the whole history (every earlier user message and the model's actual
answers, as the client received them) through ``/v1/chat/completions``, so the gateway and the
engine re-render system prompt and history with the model's chat format every turn, exactly as
a client's requests would be. Sessions advance in lockstep (turn t of every session is in flight
together, then ``--think-time`` seconds of pause), so the engines' prefix-cache counters
(``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, scraped from every engine before
and after each turn) are the turn's own.

Per turn and mode: TTFT p50/p99 (streamed), context length (prompt tokens), reusable tokens,
prefix hits (counters) and their ratio to the reusable tokens, tokens recomputed (queried - hit),
the ``usage.prompt_tokens_details.cached_tokens`` the client got, and how many sessions' turns
landed on the engine holding their history (affinity: its cached tokens exceed what any other
session's requests could have left in that engine's cache).

Reusable tokens (``reusable_tokens``), from the engine's own prompt ids (the gateway's renderer):
  colocated: the longest common prefix of turn t's prompt and turn t-1's prompt + answer ids
             (but the answer's last token, whose KV is never computed): everything before the
             new message, when the answer re-encodes to the ids the model produced;
  PD:        the longest common prefix of turn t's prompt and turn t-1's prompt only: the
             answer's KV lives on the decode instance, and a prefill instance never saw it.
Turn 1 has none (its shared system prompt aside). The engines hit whole KV blocks only (and, on
V4, only up to a boundary that has a state snapshot), so a ratio near 1 needs turns of many blocks.

Before turn 1, 2 x engines warm-up chats (sharing nothing with the sessions) go through the
gateway twice, so no engine's first (slow) request or first prefix hit is a session's.

Goals (issue 29), printed pass/fail with their numbers: hits >= 0.9 x reusable tokens over turns
2..T, and the last turn's TTFT p50 <= 2 x turn 1's. A JSON file and a PNG chart (TTFT p50 per
turn, one line per mode) go to ``--out``.

    .venv/bin/python benchmarks/sessions.py --sessions 8 --turns 10
    .venv/bin/python benchmarks/sessions.py --sessions 2 --turns 3 --user-len 8 --output-len 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from charts import line_chart

from dsv4_common.cli import build_parser
from dsv4_common.process import Service, free_port, metric_value
from dsv4_serving.bench.client import sse_lines
from dsv4_serving.bench.stats import percentile
from dsv4_serving.gateway.lifecycle import carries_text
from dsv4_serving.gateway.prompt import PromptEncoder, load_encoder

MODES = ("colocated", "pd")
QUERIES, HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "an",
    "be",
    "this",
    "which",
    "or",
    "are",
]

# An agent session's shape, the workload of ``prefix_routing.py`` (issue 31): a shared system
# prompt, then per turn a short new message after a long answer (an agent turn's output with
# its reasoning, which V4's template keeps in the history when the request has tools). A V4
# agent answers in ~0.5-2K tokens to messages of ~50; scaled to dsv4-tiny (byte-level
# vocabulary: a word here is ~3.7 tokens; 4,096 positions), 6 turns reach ~3.3K positions:
# system ~260 tokens, messages ~55, answers 448 (the answer is 8x the new message).
AGENT_SESSION = {"turns": 6, "system_len": 64, "user_len": 12, "output_len": 448}

# ---- pure pieces (tests/unit/bench/test_sessions.py) ---------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable_tokens(
    mode: str, prev_prompt: list[int], prev_answer: list[int], prompt: list[int]
) -> int:
    """Tokens of ``prompt`` whose KV the instance that computed the previous turn holds:
    colocated, the previous prompt and answer (but its last token, never fed back); PD, the
    previous prompt only (the answer was decoded elsewhere)."""
    if mode == "pd":
        return common_prefix(prompt, prev_prompt)
    return common_prefix(prompt, prev_prompt + prev_answer[:-1])


@dataclass
class Turn:
    """One session's request of one turn."""

    session: int
    turn: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details, when the engine reports it
    reusable: int = 0
    shared: int = 0  # the most any other session's requests could have left cached
    of_prompt: int = 0  # of ``reusable``: the previous prompt's part (the rest is the answer's)
    answer_ids: list[int] = field(default_factory=list)


def affine(t: Turn) -> bool | None:
    """It hit its own history (the engine holding its prefix served it); None when the answer
    cannot tell: no cached-token report, or its history reaches no further than what other
    sessions share with it."""
    if t.cached_tokens is None or t.turn == 1 or t.reusable <= t.shared:
        return None
    return t.cached_tokens > t.shared


def per_session(t: Turn) -> dict[str, Any]:
    """A request's record for the JSON file (its answer's length, not its ids)."""
    out = asdict(t)
    out["answer_tokens"] = len(out.pop("answer_ids"))
    return out


def turn_row(turns: list[Turn], queried: float, hit: float) -> dict[str, Any]:
    """A turn's figures over its sessions' requests and the counters' growth over it."""
    ok = [t for t in turns if t.ok]
    ttfts = [t.ttft for t in ok]
    reusable = sum(t.reusable for t in turns)
    cached = [t.cached_tokens for t in ok if t.cached_tokens is not None]
    verdicts = [v for t in ok if (v := affine(t)) is not None]
    return {
        "turn": turns[0].turn,
        "requests": len(turns),
        "failed": len(turns) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "context_tokens_mean": sum(t.prompt_tokens for t in ok) / max(1, len(ok)),
        "reusable_tokens": reusable,
        "queried_tokens": int(queried),
        "hit_tokens": int(hit),
        "hit_ratio": hit / reusable if reusable else None,
        "recomputed_tokens": int(queried - hit),
        "reported_cached_tokens": sum(cached) if cached else None,
        "affine": f"{sum(verdicts)}/{len(verdicts)}" if verdicts else "n/a",
    }


def goal_checks(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 29's goals over a mode's rows: hits >= 0.9 x reusable (turns 2..T), and the last
    turn's TTFT p50 <= 2 x turn 1's."""
    later = [r for r in rows if r["turn"] > 1]
    reusable = sum(r["reusable_tokens"] for r in later)
    hits = sum(r["hit_tokens"] for r in later)
    ratio = hits / reusable if reusable else None
    first, last = rows[0]["ttft_p50_s"], rows[-1]["ttft_p50_s"]
    growth = last / first if first and len(rows) > 1 else None
    return {
        "prefix_hit_ratio": {
            "value": ratio,
            "hits": hits,
            "reusable": reusable,
            "goal": ">= 0.9",
            "pass": ratio is not None and ratio >= 0.9,
        },
        "ttft_growth": {
            "value": growth,
            "first_turn_s": first,
            "last_turn": rows[-1]["turn"],
            "last_turn_s": last,
            "goal": "<= 2.0",
            "pass": growth is not None and growth <= 2.0,
        },
    }


# ---- the chats --------------------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def letters_bias(enc: PromptEncoder) -> dict[str, float]:
    """logit_bias that keeps a greedy answer in lowercase letters and spaces. Random weights
    answer random bytes, whose text (invalid UTF-8 replaced) re-encodes to other ids, so the
    history a client sends back would stop matching the cache at the answer; a real model's
    text re-encodes to its ids (``--free-answers``)."""
    ids = {i for ch in "abcdefghijklmnopqrstuvwxyz " for i in enc(ch)[:1]}
    return {str(i): 100.0 for i in sorted(ids)}


def request_body(
    model: str, messages: list[dict[str, str]], args: argparse.Namespace, bias: dict[str, float]
) -> dict[str, Any]:
    extra = {"logit_bias": bias} if bias else {}
    return {
        **extra,
        "model": model,
        "messages": messages,
        "max_tokens": args.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # vLLM's extension: the answer's ids, for the accounting
        "chat_template_kwargs": {"thinking": args.thinking},
    }


async def send_turn(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], turn: Turn, timeout_s: float
) -> str:
    """Stream one turn: TTFT, usage and the answer's ids into ``turn``; returns its text."""
    text: list[str] = []
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                turn.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return ""
            async for line in sse_lines(resp.aiter_bytes()):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if turn.ttft == 0.0 and carries_text(line[6:].encode()):
                    turn.ttft = time.perf_counter() - start
                for c in event.get("choices") or []:
                    text.append(c.get("delta", {}).get("content") or "")
                    turn.answer_ids += c.get("token_ids") or []
                usage = event.get("usage")
                if usage:
                    turn.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        turn.cached_tokens = int(details["cached_tokens"])
    except (TimeoutError, httpx.HTTPError, json.JSONDecodeError) as e:
        turn.error = f"{type(e).__name__}: {e}"
        return ""
    turn.ok = turn.ttft > 0.0
    turn.error = turn.error or ("" if turn.ok else "no tokens in the answer")
    return "".join(text)


@dataclass
class Session:
    index: int
    messages: list[dict[str, str]]
    prompt_ids: list[int] = field(default_factory=list)
    answer_ids: list[int] = field(default_factory=list)


def account(
    mode: str,
    enc: PromptEncoder,
    body: dict[str, Any],
    s: Session,
    turn: Turn,
    served: dict[int, list[int]],
) -> list[int]:
    """Fill ``turn.reusable`` and ``turn.shared`` from the engine's prompt ids of ``body``
    (``served``: every session's latest cached sequence); returns those ids."""
    ids = enc.chat(body) or []
    if s.prompt_ids:
        turn.reusable = reusable_tokens(mode, s.prompt_ids, s.answer_ids, ids)
        turn.of_prompt = common_prefix(ids, s.prompt_ids)
    others = [common_prefix(ids, seq) for i, seq in served.items() if i != s.index]
    turn.shared = max(others, default=0)
    return ids


async def warm_up(
    client: httpx.AsyncClient,
    endpoint: str,
    model: str,
    args: argparse.Namespace,
    bias: dict[str, float],
    n: int,
) -> None:
    """``n`` chats at once, twice, sharing nothing with the sessions, so that no engine's
    first request (its slow one) or first prefix hit is a session's."""
    rng = random.Random(-1 - args.seed)
    bodies = [
        request_body(
            model, [{"role": "user", "content": f"{i} " + words(rng, args.user_len)}], args, bias
        )
        for i in range(n)
    ]
    for _ in range(2):  # twice: the second round takes the prefix-hit path (state restore)
        turns = [Turn(-1, 0) for _ in bodies]
        sends = [
            send_turn(client, endpoint, b, t, args.timeout)
            for b, t in zip(bodies, turns, strict=True)
        ]
        await asyncio.gather(*sends)
        failed = [t.error for t in turns if not t.ok]
        if failed:
            print(f"  warm-up: {len(failed)}/{n} failed: {failed[0]}", flush=True)


async def run_sessions(
    mode: str, url: str, model: str, args: argparse.Namespace, engines: list[Service]
) -> list[dict[str, Any]]:
    """Every session's turns in lockstep; one row per turn (``turn_row``)."""
    enc = load_encoder(args.model)
    bias = {} if args.free_answers else letters_bias(enc)
    rng = random.Random(args.seed)
    system = {"role": "system", "content": "You are a coding agent. " + words(rng, args.system_len)}
    sessions = [Session(i, [system]) for i in range(args.sessions)]
    served: dict[int, list[int]] = {}
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.duration
    endpoint = f"{url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0)) as client:
        await warm_up(client, endpoint, model, args, bias, 2 * len(engines))
        for t in range(1, args.turns + 1):
            if time.monotonic() > deadline:
                print(f"  {mode}: --duration reached before turn {t}", flush=True)
                break
            before = await scrape(engines)
            started = time.time()
            jobs, turns = [], []
            for s in sessions:
                s.messages.append(
                    {"role": "user", "content": f"Task {s.index}.{t}: " + words(rng, args.user_len)}
                )
                body = request_body(model, s.messages, args, bias)
                turn = Turn(s.index, t)
                s.prompt_ids = account(mode, enc, body, s, turn, served)
                turns.append(turn)
                jobs.append(send_turn(client, endpoint, body, turn, args.timeout))
            answers = await asyncio.gather(*jobs)
            window = [started, time.time()]  # unix seconds: the turn's requests, for traces
            for s, turn, answer in zip(sessions, turns, answers, strict=True):
                if mode == "pd":  # the client's usage is the decode's, not the prefill's
                    turn.cached_tokens = None
                s.messages.append({"role": "assistant", "content": answer})
                s.answer_ids = turn.answer_ids
                served[s.index] = s.prompt_ids + (s.answer_ids if mode == "colocated" else [])
            after = await settled(engines, before, sum(t.prompt_tokens for t in turns if t.ok))
            rows.append(turn_row(turns, after[0] - before[0], after[1] - before[1]))
            rows[-1]["per_session"] = [per_session(t) for t in turns]
            rows[-1]["window_unix_s"] = window
            print(f"  {mode} turn {t}: {format_row(rows[-1])}", flush=True)
            if args.think_time and t < args.turns:
                await asyncio.sleep(args.think_time)
    return rows


# ---- the stack and its counters -----------------------------------------------------------


async def scrape(engines: list[Service]) -> tuple[float, float]:
    """Prefix-cache queries and hits (tokens), summed over every engine."""
    queried = hit = 0.0
    async with httpx.AsyncClient(timeout=10) as client:
        for e in engines:
            text = (await client.get(f"{e.url}/metrics")).text
            queried += metric_value(text, QUERIES)
            hit += metric_value(text, HITS)
    return queried, hit


async def settled(
    engines: list[Service], before: tuple[float, float], prompt_tokens: int
) -> tuple[float, float]:
    """The counters once the turn's lookups are published (the engines publish their stats
    with their step outputs; a little later at worst), waiting at most 3 s."""
    deadline = time.monotonic() + 3.0
    while True:
        now = await scrape(engines)
        if now[0] - before[0] >= prompt_tokens or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)


def stack_args(mode: str, args: argparse.Namespace, run_dir: Path) -> argparse.Namespace:
    """``dsv4 up``'s namespace for ``mode``, parsed by its own parser (every flag it has gets
    its default, so a new one cannot break the plan)."""
    shape = (
        ["--no-pd", "--decode", str(args.engines)]
        if mode == "colocated"
        else ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    )
    return build_parser("up").parse_args(
        [
            "up",
            *("--model", args.model, "--port", str(free_port()), "--log-dir", str(run_dir)),
            *shape,
            *(f"--engine-arg={a}" for a in args.engine_arg),  # "=": values may start with "--"
        ]
    )


def run_mode(mode: str, args: argparse.Namespace, run_dir: Path) -> list[dict[str, Any]]:
    """Start the mode's stack, replay the sessions through its gateway, stop it."""
    from dsv4_serving.commands import up

    stack = stack_args(mode, args, run_dir / mode)
    stack.log_dir.mkdir(parents=True, exist_ok=True)
    up.check_counts(stack)
    children = up.plan(stack, stack.log_dir)
    gateway = children[-1]
    engines = [c for c in children if c is not gateway and not c.name.endswith("sidecar")]
    print(f"{mode}: {', '.join(c.name for c in engines)}; logs in {stack.log_dir}", flush=True)
    try:
        up.start_in_order(children, stack.startup_timeout)
        return asyncio.run(run_sessions(mode, gateway.url, Path(args.model).name, args, engines))
    finally:
        for c in reversed(children):
            c.stop(timeout_s=15.0)


# ---- the report ---------------------------------------------------------------------------


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def format_row(r: dict[str, Any]) -> str:
    return (
        f"TTFT p50 {_f(r['ttft_p50_s'] * 1000, '.0f')} ms, context {r['context_tokens_mean']:.0f}, "
        f"reusable {r['reusable_tokens']}, hit {r['hit_tokens']} "
        f"({_f(r['hit_ratio'], '.2f')}), recomputed {r['recomputed_tokens']}, "
        f"affine {r['affine']}, failed {r['failed']}"
    )


COLUMNS = (
    ("ttft p50", "ttft_p50_s", lambda x: _f(x * 1000, ".0f")),
    ("p99", "ttft_p99_s", lambda x: _f(x * 1000, ".0f")),
    ("ctx", "context_tokens_mean", lambda x: _f(x, ".0f")),
    ("reuse", "reusable_tokens", str),
    ("hit", "hit_tokens", str),
    ("ratio", "hit_ratio", lambda x: _f(x, ".2f")),
    ("recomp", "recomputed_tokens", str),
    ("cached", "reported_cached_tokens", lambda x: "-" if x is None else str(x)),
    ("affine", "affine", str),
)


def format_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Turn per line, the modes side by side (TTFT in ms, tokens summed over sessions)."""
    modes = list(results)
    head = "turn " + " | ".join(" ".join(f"{c:>8}" for c, _, _ in COLUMNS) for _ in modes)
    title = "     " + " | ".join(f"{m:<{9 * len(COLUMNS) - 1}}" for m in modes)
    lines = [title, head]
    for t in range(max(len(rows) for rows in results.values())):
        cells = []
        for m in modes:
            rows = results[m]
            if t < len(rows):
                cells.append(" ".join(f"{fmt(rows[t][k]):>8}" for _, k, fmt in COLUMNS))
            else:
                cells.append(" " * (9 * len(COLUMNS) - 1))
        lines.append(f"{t + 1:>4} " + " | ".join(cells))
    return "\n".join(lines)


def format_goals(mode: str, goals: dict[str, dict[str, Any]]) -> list[str]:
    h, g = goals["prefix_hit_ratio"], goals["ttft_growth"]
    return [
        f"{mode}: prefix hits / reusable tokens (turns 2..) = {_f(h['value'], '.3f')} "
        f"({h['hits']} / {h['reusable']}), goal >= 0.9: {'PASS' if h['pass'] else 'FAIL'}",
        f"{mode}: TTFT p50 turn {g['last_turn']} / turn 1 = {_f(g['value'], '.2f')} "
        f"({_f(g['last_turn_s'], '.3f')} s / {_f(g['first_turn_s'], '.3f')} s), goal <= 2: "
        f"{'PASS' if g['pass'] else 'FAIL'}",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=8, help="concurrent sessions (default 8)")
    p.add_argument("--turns", type=int, default=10, help="turns per session (default 10)")
    p.add_argument("--modes", default="colocated,pd", help="colocated, pd or both (default)")
    p.add_argument("--system-len", type=int, default=32, help="system prompt words (shared)")
    p.add_argument("--user-len", type=int, default=64, help="words per new user message")
    p.add_argument("--output-len", type=int, default=32, help="answer tokens (ignore_eos)")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    p.add_argument("--duration", type=float, default=1800.0, help="most seconds per mode")
    p.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    p.add_argument("--thinking", action="store_true", help="thinking on (history drops it)")
    p.add_argument(
        "--free-answers",
        action="store_true",
        help="no logit_bias to letters (use with real weights; see letters_bias)",
    )
    p.add_argument("--engines", type=int, default=2, help="colocated: engines doing both")
    p.add_argument("--prefill", type=int, default=2, help="PD: prefill engines (default 2)")
    p.add_argument("--decode", type=int, default=1, help="PD: decode engines (default 1)")
    p.add_argument("--engine-arg", action="append", default=[], help="to every engine")
    p.add_argument("--model", default="dsv4-tiny", help="a DeepSeek-format preset or checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seeds the messages")
    p.add_argument("--out", type=Path, default=Path("sessions-out"), help="JSON, PNG and logs")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: {bad or 'none'} not in {', '.join(MODES)}")
    for flag in ("sessions", "turns", "user_len", "output_len", "engines", "prefill", "decode"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.system_len < 0 or args.think_time < 0 or args.duration <= 0:
        p.error("--system-len and --think-time must be >= 0, --duration > 0")
    return args


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="logs-", dir=args.out))
    results: dict[str, list[dict[str, Any]]] = {}
    for mode in args.modes:
        results[mode] = run_mode(mode, args, run_dir)
    goals = {m: goal_checks(rows) for m, rows in results.items() if rows}
    print("\n== sessions: per turn (TTFT ms; tokens summed over the sessions) ==")
    print(format_table(results))
    print("reusable: colocated = history before the new message; pd = the previous prompt only")
    print("(a prefill instance never saw the previous answer: its KV is on the decode instance)")
    for m, g in goals.items():
        print("\n".join(format_goals(m, g)))
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out = {"config": config, "modes": results, "goals": goals}
    (args.out / "sessions.json").write_text(json.dumps(out, indent=2))
    series = {m: [(r["turn"], r["ttft_p50_s"]) for r in rows] for m, rows in results.items()}
    png = line_chart(args.out / "sessions-ttft.png", "TTFT p50 per turn", "turn", "seconds", series)
    print(f"\nwrote {args.out / 'sessions.json'} and {png}; logs in {run_dir}")
    failed = sum(r["failed"] for rows in results.values() for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
