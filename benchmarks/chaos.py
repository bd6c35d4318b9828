"""Chaos soak: the ``dsv4 up`` stack (2 prefill + 2 decode engines with their KV sidecars, a
gateway) under streamed ``dsv4 bench`` requests for a bounded time, while engines and sidecars
are killed (SIGKILL, or SIGTERM with --signal term) and restarted at random (seeded).

Prints requests sent / succeeded / failed by kind / hung (our own deadline passed: must be 0),
the success rate of the requests that were not in flight when a process died, and what leaked:
KV blocks (each engine's free blocks against its total) and staging bytes (each sidecar's used
bytes), which must be 0 once the stack is idle. Exit status 1 when anything hung or leaked.

    .venv/bin/python benchmarks/chaos.py --duration 60 --seed 1

``--scenario decode-kill|drain`` instead runs ``--streams`` long streams at once and, once they
are under way, SIGKILLs the decode engine serving most of them (its streams are recomputed
elsewhere) or asks it ``POST /drain`` (their KV moves to a peer), and prints: streams failed or
cut (goal 0), how many moved, the extra latency of the moved streams (each stream's longest
gap between two tokens less its median gap: p50, p99), the drain's duration (until the victim
runs nothing) beside the longest remaining generation (what a drain that waits would take), and
the tokens computed again (prefill engines' prompt tokens not served from their prefix cache
after the event, plus decode requests whose KV pull failed and were prefilled locally).

    .venv/bin/python benchmarks/chaos.py --scenario drain --streams 16 --output-len 400

``--scenario rollout`` replaces every decode engine in turn under a steady streaming load
(``--streams`` at once, each answered stream followed by a new one): ``POST /drain`` (its
streams move with their KV to a peer), wait until it runs nothing and its sidecar holds no
export, stop it, start it again on the same port with ``--rollout-arg`` added (the new
revision), wait until the gateway routes to it again, then the next. ``dsv4 up``'s gateway has
static members and no API to change them at run time, so the new engine takes the old one's
port (the operator's rollouts start new instances beside the old instead). It prints streams
failed or cut (goal 0), how many moved, their extra latency (p50, p99), each engine's drain
duration beside the longest remaining generation of the streams in flight at its drain, and
the decode requests recomputed after a failed or refused KV pull.

    .venv/bin/python benchmarks/chaos.py --scenario rollout --streams 16 --output-len 400

The stack is ``dsv4 up``'s own plan, its namespace parsed by ``dsv4 up``'s parser, so a new
``dsv4 up`` flag cannot break this script. A smoke run (``tests/gateway/test_chaos_smoke.py``):

    .venv/bin/python benchmarks/chaos.py --prefill 1 --decode 1 --requests 8 --max-kills 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dsv4_common.cli import build_parser
from dsv4_common.process import Service, free_port
from dsv4_kvtransfer.launch import SidecarService
from dsv4_serving.bench.client import one_request, random_prompts
from dsv4_serving.bench.stats import RequestRecord
from dsv4_serving.commands import up


@dataclass
class Sent:
    start: float
    end: float
    record: RequestRecord


@dataclass
class Chaos:
    """What was killed when, and for how long it was down."""

    kills: list[tuple[float, str]] = field(default_factory=list)
    downs: list[tuple[float, float]] = field(default_factory=list)
    restart_failures: list[str] = field(default_factory=list)


def kind(error: str) -> str:
    """A failure's kind: the OpenAI error code of an HTTP error, else what broke."""
    m = re.match(r"HTTP (\d+): (.*)", error, re.S)
    if m:
        try:
            code = json.loads(m.group(2))["error"].get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            code = None
        return f"HTTP {m.group(1)} {code or '(no code)'}"
    if error.startswith("timed out"):
        return "hung"
    if "broke off" in error:  # the gateway's error event: the engine died mid-stream
        return "stream broken off (its engine died)"
    return re.sub(r"https?://\S+", "URL", error).split(":")[0][:60] or "unknown"


def _kill(c: Service, sig: signal.Signals) -> None:
    """SIGKILL: the whole process group (the engine core too), as when a container is killed;
    SIGTERM: the leader only, as Kubernetes signals a container's main process."""
    if c.pid is not None and c.running():
        with contextlib.suppress(ProcessLookupError):
            if sig == signal.SIGKILL:
                os.killpg(c.pid, sig)
            else:
                os.kill(c.pid, sig)


def chaos_loop(
    victims: list[Service],
    rng: random.Random,
    every_s: float,
    down_s: float,
    sig: signal.Signals,
    stop: threading.Event,
    t0: float,
    out: Chaos,
    max_kills: int = 0,
) -> None:
    """Kill a random victim every ~``every_s`` s (exponential gaps), restart it ``down_s`` later;
    at most ``max_kills`` kills (0: no limit), then wait for the end."""
    while not stop.wait(rng.expovariate(1.0 / every_s)):
        if max_kills and len(out.kills) >= max_kills:
            stop.wait()
            return
        victim = rng.choice(victims)
        killed = time.monotonic()
        out.kills.append((killed - t0, victim.name))
        print(f"  [{killed - t0:6.1f}s] {sig.name} {victim.name}", flush=True)
        _kill(victim, sig)
        deadline = time.monotonic() + 30
        while victim.running() and time.monotonic() < deadline:
            time.sleep(0.05)  # a SIGTERM drains first
        stop.wait(down_s)
        try:
            up.restart(victim, timeout_s=180)
        except up.StartFailed as e:
            out.restart_failures.append(f"{victim.name}: {e}")
        out.downs.append((killed - t0, time.monotonic() - t0))
        print(f"  [{time.monotonic() - t0:6.1f}s] {victim.name} back", flush=True)


async def load(
    url: str,
    args: argparse.Namespace,
    t0: float,
    stop: threading.Event,
) -> list[Sent]:
    prompts = random_prompts(
        4096, args.input_len, 0.5, args.output_len, args.seed, False, args.model
    )
    sent: list[Sent] = []
    numbers = itertools.count()  # shared: --requests bounds all workers together
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.hung_s)) as client:

        async def worker() -> None:
            while not stop.is_set():
                i = next(numbers)
                if args.requests and i >= args.requests:
                    return
                start = time.monotonic() - t0
                rec = await one_request(
                    client, f"{url}/v1/completions", prompts[i % len(prompts)], {}, args.hung_s
                )
                sent.append(Sent(start, time.monotonic() - t0, rec))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return sent


def leaks(children: list[Service], settle_s: float) -> dict[str, float]:
    """KV blocks and staging bytes still held once idle (0 each when nothing leaked)."""
    deadline = time.monotonic() + settle_s
    while True:
        out: dict[str, float] = {}
        for c in children:
            try:
                if isinstance(c, SidecarService):
                    info = httpx.get(f"{c.url}/v1/info", timeout=5).json()
                    out[f"{c.name} staging bytes"] = float(info["used_bytes"])
                elif c.name != "gateway":
                    total = c.metric("dsv4_kv_cache_total_blocks")
                    out[f"{c.name} KV blocks"] = total - c.metric("dsv4_kv_cache_free_blocks")
            except (httpx.HTTPError, OSError, ValueError) as e:
                out[f"{c.name} unreachable ({type(e).__name__})"] = 1.0
        if not any(out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def report(sent: list[Sent], chaos: Chaos, leaked: dict[str, float]) -> int:
    ok = [s for s in sent if s.record.ok]
    failed = [s for s in sent if not s.record.ok]
    kinds = Counter(kind(s.record.error) for s in failed)
    hung = kinds.pop("hung", 0)
    # in flight when a process died: those may fail (with a clear error); the others should not
    untouched = [s for s in sent if not any(s.start <= k <= s.end for k, _ in chaos.kills)]
    untouched_ok = sum(s.record.ok for s in untouched)
    print("\n== chaos soak ==")
    print(f"processes killed:   {len(chaos.kills)} ({Counter(n for _, n in chaos.kills)})")
    print(f"requests sent:      {len(sent)}")
    print(f"  succeeded:        {len(ok)}")
    print(f"  failed (clear):   {sum(kinds.values())}")
    for k, n in kinds.most_common():
        print(f"    {n:5d}  {k}")
    print(f"  hung:             {hung}  (must be 0)")
    rate = 100.0 * untouched_ok / max(1, len(untouched))
    print(
        f"not in flight at a kill: {untouched_ok}/{len(untouched)} succeeded ({rate:.1f}%; goal 99%)"
    )
    for name, value in leaked.items():
        print(f"leaked {name}: {value:g}  (must be 0)")
    for f in chaos.restart_failures:
        print(f"restart failed: {f}")
    examples = {kind(s.record.error): s.record.error for s in failed}
    for k, e in examples.items():
        print(f"  e.g. {k}: {e[:160]}")
    bad = hung or any(leaked.values()) or chaos.restart_failures
    return 1 if bad else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load and chaos (most)")
    p.add_argument("--requests", type=int, default=0, help="stop after this many (0: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seeds the victims, the gaps, the prompts")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--input-len", type=int, default=48, help="prompt tokens (about)")
    p.add_argument("--output-len", type=int, default=16, help="tokens per answer")
    p.add_argument("--prefill", type=int, default=2, help="prefill engines (each with a sidecar)")
    p.add_argument("--decode", type=int, default=2, help="decode engines (each with a sidecar)")
    p.add_argument("--kill-every", type=float, default=8.0, help="mean seconds between kills")
    p.add_argument("--max-kills", type=int, default=0, help="at most this many (0: no limit)")
    p.add_argument("--down", type=float, default=1.0, help="seconds a killed process stays down")
    p.add_argument("--signal", choices=["kill", "term"], default="kill", help="how to kill")
    p.add_argument("--hung-s", type=float, default=90.0, help="a request longer than this hung")
    p.add_argument("--settle", type=float, default=60.0, help="seconds to wait for idle")
    p.add_argument(
        "--scenario",
        choices=list(SCENARIOS),
        default="soak",
        help="soak: random kills under load; decode-kill / drain: one event under --streams; "
        "rollout: every decode engine replaced in turn under --streams",
    )
    p.add_argument(
        "--rollout-arg",
        action="append",
        default=None,
        help="rollout: an engine flag the new engines get, as --rollout-arg=--flag=value "
        "(repeatable; default --max-num-seqs=48, outside the KV layout fingerprint, so moved "
        "and new streams pull KV across the old and new engines; --revision=NAME makes the "
        "KV of the two revisions incompatible: pulls across them are refused and recomputed)",
    )
    p.add_argument(
        "--streams", type=int, default=16, help="decode-kill / drain / rollout: streams at once"
    )
    p.add_argument(
        "--move-after",
        type=float,
        default=2.0,
        help="decode-kill / drain: seconds into the streams; rollout: before the first "
        "replacement and after the last",
    )
    p.add_argument("--model", default="dsv4-tiny")
    p.add_argument("--log-dir", type=Path, default=None)
    return p.parse_args(argv)


def stack_args(args: argparse.Namespace, run_dir: Path) -> argparse.Namespace:
    """``dsv4 up``'s namespace for this stack, parsed by ``dsv4 up``'s own parser: every flag it
    has gets its default, so a new one cannot break the plan."""
    engine = ["--shutdown-timeout", "10", "--kv-pull-timeout", "10"]
    return build_parser("up").parse_args(
        [
            "up",
            *("--model", args.model, "--port", str(free_port()), "--log-dir", str(run_dir)),
            *("--prefill", str(args.prefill), "--decode", str(args.decode)),
            *(f"--engine-arg={a}" for a in engine),  # "=": the values start with "--"
        ]
    )


def soak(
    args: argparse.Namespace, gateway: Service, victims: list[Service]
) -> tuple[list[Sent], Chaos]:
    """The load on a thread of its own and the chaos on this one, until --duration passes or
    --requests are answered."""
    stop = threading.Event()
    chaos = Chaos()
    t0 = time.monotonic()
    # the chaos runs on this thread: processes die with the thread that started them
    # (PR_SET_PDEATHSIG), so restarts must come from one that lives to the end
    sent: list[Sent] = []

    def load_then_stop() -> None:
        try:
            sent.extend(asyncio.run(load(gateway.url, args, t0, stop)))
        finally:
            stop.set()

    loader = threading.Thread(target=load_then_stop, daemon=True)
    loader.start()
    timer = threading.Timer(args.duration, stop.set)
    timer.start()
    sig = signal.SIGKILL if args.signal == "kill" else signal.SIGTERM
    rng = random.Random(args.seed)
    chaos_loop(victims, rng, args.kill_every, args.down, sig, stop, t0, chaos, args.max_kills)
    timer.cancel()
    loader.join(args.hung_s + 60)
    return sent, chaos


def engines(children: list[Service]) -> list[Service]:
    return [c for c in children if not isinstance(c, SidecarService) and c.name != "gateway"]


def _busiest(gateway: Service, decodes: list[Service]) -> Service:
    load = {i["url"]: i["inflight_requests"] for i in httpx.get(f"{gateway.url}/instances").json()}
    return max(decodes, key=lambda d: load.get(d.url, 0))


def _computed(prefills: list[Service]) -> float:
    """Prompt tokens the prefill engines computed (not served from their prefix cache)."""
    return sum(
        e.metric("vllm:prefix_cache_queries_total") - e.metric("vllm:prefix_cache_hits_total")
        for e in prefills
    )


def _event(args: argparse.Namespace, victim: Service) -> float | None:
    """Kill or drain ``victim``; the drain's duration (until it runs nothing), or None."""
    t = time.monotonic()
    if args.scenario == "decode-kill":
        _kill(victim, signal.SIGKILL)
        return None
    answer = httpx.post(f"{victim.url}/drain", json={}, timeout=10).json()
    print(f"  drain: {answer}", flush=True)
    while victim.metric("vllm:num_requests_running") and time.monotonic() - t < 120:
        time.sleep(0.02)
    return time.monotonic() - t


def move(
    args: argparse.Namespace, gateway: Service, decodes: list[Service], prefills: list[Service]
) -> int:
    """``--streams`` streams, one kill or drain of the decode engine serving most of them."""
    args.requests, args.concurrency = args.streams, args.streams
    stop = threading.Event()
    t0 = time.monotonic()
    sent: list[Sent] = []
    loader = threading.Thread(
        target=lambda: sent.extend(asyncio.run(load(gateway.url, args, t0, stop))), daemon=True
    )
    loader.start()
    time.sleep(args.move_after)
    victim = _busiest(gateway, decodes)
    peers = [d for d in decodes if d is not victim]
    before = (_computed(prefills), sum(d.metric("dsv4_kv_recomputes_total") for d in peers))
    moved0 = gateway.metric("dsv4_gateway_stream_migrations_total", outcome="continued")
    at = time.monotonic() - t0
    print(f"  [{at:6.1f}s] {args.scenario} {victim.name}", flush=True)
    drain_s = _event(args, victim)
    loader.join(args.hung_s + 60)
    recomputed = _computed(prefills) - before[0]
    failed_pulls = sum(d.metric("dsv4_kv_recomputes_total") for d in peers) - before[1]
    moved = gateway.metric("dsv4_gateway_stream_migrations_total", outcome="continued") - moved0
    return move_report(args, sent, at, moved, drain_s, recomputed, failed_pulls)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def extra_latency(sent: list[Sent], ats: list[float], moved: float) -> list[float]:
    """The moved streams' extra latency, sorted: of the streams in flight at an event, the
    ``moved`` with the longest gap between two tokens beyond their median gap."""
    return sorted(
        max(s.record.itl) - sorted(s.record.itl)[len(s.record.itl) // 2]
        for s in sent
        if s.record.ok and s.record.itl and any(s.start <= at <= s.end for at in ats)
    )[-max(1, int(moved)) :]


def move_report(
    args: argparse.Namespace,
    sent: list[Sent],
    at: float,
    moved: float,
    drain_s: float | None,
    recomputed: float,
    failed_pulls: float,
) -> int:
    failed = [s for s in sent if not s.record.ok]
    cut = [s for s in failed if "broke off" in s.record.error]
    extra = extra_latency(sent, [at], moved)
    remaining = max((s.end - at for s in sent), default=0.0)
    print(f"\n== chaos {args.scenario} ==")
    print(f"streams:            {len(sent)} of {args.output_len} tokens")
    print(f"  failed:           {len(failed) - len(cut)}  (goal 0)")
    print(f"  cut:              {len(cut)}  (goal 0)")
    print(f"  moved:            {moved:g}")
    print(f"extra latency of moved streams: p50 {pct(extra, 0.5):.3f}s p99 {pct(extra, 0.99):.3f}s")
    if drain_s is not None:
        print(
            f"drain duration:     {drain_s:.3f}s (the longest remaining generation: {remaining:.3f}s)"
        )
    print(f"tokens recomputed:  {recomputed:g} (+ {failed_pulls:g} requests after a failed pull)")
    for s in failed[:3]:
        print(f"  e.g. {s.record.error[:160]}")
    return 1 if failed else 0


SCENARIOS = ("soak", "decode-kill", "drain", "rollout")


def main() -> int:
    args = parse_args()
    run_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="dsv4-chaos-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = stack_args(args, run_dir)
    up.check_counts(stack)
    children = up.plan(stack, run_dir)
    gateway = children[-1]
    gateway.argv += ["--health-interval", "0.5", "--retries", "2", "--prefill-timeout", "30"]
    victims = [c for c in children if c is not gateway]
    print(f"chaos: {len(children)} processes, logs in {run_dir}", flush=True)
    try:
        up.start_in_order(children, stack.startup_timeout)
        if args.scenario != "soak":
            decodes = [c for c in victims if "decode" in c.name and c in engines(children)]
            prefills = [c for c in engines(children) if c not in decodes]
            if args.scenario == "rollout":
                from chaos_rollout import rollout  # it imports this module's parts

                return rollout(args, gateway, decodes, prefills, children)
            return move(args, gateway, decodes, prefills)
        print(f"up: {gateway.url}; at most {args.duration:.0f}s of load and chaos", flush=True)
        sent, chaos = soak(args, gateway, victims)
        for c in victims:  # whatever was down when the chaos stopped
            if not c.running():
                up.restart(c, 180)
        leaked = leaks(children, args.settle)
        return report(sent, chaos, leaked)
    except up.StartFailed as e:
        print(f"chaos: the stack did not start: {e}", file=sys.stderr)
        return 2
    finally:
        for c in reversed(children):
            c.stop(timeout_s=15.0)


if __name__ == "__main__":
    sys.exit(main())
