"""``benchmarks/chaos.py --scenario rollout``: every decode engine of a ``dsv4 up`` stack
replaced in turn under steady streaming load (drained with its KV moved, stopped, started again
on its port with ``--rollout-arg``); the scenario and its report (``chaos.py``'s docstring)."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from chaos import Sent, extra_latency, load, pct

from dsv4_common.process import Service, metric_value
from dsv4_serving.commands import up


@dataclass
class Replaced:
    """One decode engine's turn in a rollout."""

    name: str
    at: float
    drain_s: float
    ready_s: float
    answer: dict[str, object]
    sent_bytes: float
    """KV bytes the victim's sidecar sent during its drain (the peers' pulls of moved KV)."""


def _sidecar(children: list[Service], engine: Service) -> Service:
    return next(c for c in children if c.name == f"{engine.name}-sidecar")


def _busy(engine: Service, sidecar: Service) -> tuple[int, float]:
    """``POST /drain`` again (a stream still in its prefill at the last call moves now): the
    requests the engine still answers (its own count: its core's running gauge can keep the
    moved streams until its next busy step), and the KV exports its sidecar holds for a peer
    still to pull."""
    answer = httpx.post(f"{engine.url}/drain", json={"migrate": True}, timeout=10).json()
    side = httpx.get(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=5).text
    return int(answer["in_flight"]), metric_value(side, "dsv4_kv_active_exports")


def _routed_again(gateway: Service, engine: Service, timeout_s: float) -> None:
    """Until the gateway routes to ``engine`` again (healthy, not draining)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i in httpx.get(f"{gateway.url}/instances", timeout=5).json():
            if i["url"] == engine.url and i["healthy"] and not i["draining"]:
                return
        time.sleep(0.1)
    raise up.StartFailed(f"{engine.name}: the gateway did not route to it again")


def _with_flags(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` with each ``--flag=value`` of ``flags`` set (an earlier value replaced)."""
    out = list(argv)
    for f in flags:
        name = f.split("=", 1)[0]
        out = [a for a in out if a.split("=", 1)[0] != name or "=" not in a]
        if name in out:  # "--flag value": drop both
            i = out.index(name)
            del out[i : i + 2]
        out.append(f)
    return out


def _sent(sidecar: Service) -> float:
    side = httpx.get(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=5).text
    return metric_value(side, "dsv4_kv_transfer_bytes_total", direction="sent")


def _replace(
    engine: Service, sidecar: Service, gateway: Service, flags: list[str], t0: float
) -> Replaced:
    """Drain ``engine`` by moving its streams, stop it once idle, start it with ``flags``."""
    at, sent0 = time.monotonic(), _sent(sidecar)
    print(f"  [{at - t0:6.1f}s] rollout: POST /drain {engine.name}", flush=True)
    answer = httpx.post(f"{engine.url}/drain", json={"migrate": True}, timeout=10).json()
    last = (-1, -1.0)
    while any(busy := _busy(engine, sidecar)) and time.monotonic() - at < 120:
        if busy != last:  # what the drain waits for, as it changes
            print(f"    in flight {busy[0]}, exports held {busy[1]:g}", flush=True)
            last = busy
        time.sleep(0.05)
    drained, sent = time.monotonic(), _sent(sidecar) - sent0
    engine.stop(timeout_s=15.0)
    engine.argv = _with_flags(engine.argv, flags)
    up.restart(engine, timeout_s=180)
    running = Path(f"/proc/{engine.pid}/cmdline").read_bytes().decode().split("\0")
    if not set(flags) <= set(running):  # the new engine is the new revision
        raise up.StartFailed(f"{engine.name} runs without {flags}: {running}")
    _routed_again(gateway, engine, 60)
    print(f"  [{time.monotonic() - t0:6.1f}s] rollout: {engine.name} back, routed", flush=True)
    return Replaced(engine.name, at - t0, drained - at, time.monotonic() - drained, answer, sent)


def rollout(
    args: argparse.Namespace,
    gateway: Service,
    decodes: list[Service],
    prefills: list[Service],
    children: list[Service],
) -> int:
    """A steady load of ``--streams`` streams; every decode engine replaced in turn."""
    del prefills  # under a steady load their computed tokens are mostly new prompts
    args.requests, args.concurrency = 0, args.streams
    flags = args.rollout_arg or ["--max-num-seqs=48"]
    stop = threading.Event()
    t0 = time.monotonic()
    sent: list[Sent] = []
    loader = threading.Thread(
        target=lambda: sent.extend(asyncio.run(load(gateway.url, args, t0, stop))), daemon=True
    )
    loader.start()
    time.sleep(args.move_after)
    moved0 = gateway.metric("dsv4_gateway_stream_migrations_total", outcome="continued")
    recomputed = 0.0
    turns: list[Replaced] = []
    try:
        for d in decodes:
            # a counter of the process about to stop: read it now, its successor starts at 0
            recomputed += d.metric("dsv4_kv_recomputes_total")
            turns.append(_replace(d, _sidecar(children, d), gateway, flags, t0))
        time.sleep(args.move_after)  # the last one serves again before the load stops
    finally:
        stop.set()
        loader.join(args.hung_s + 60)
    recomputed += sum(d.metric("dsv4_kv_recomputes_total") for d in decodes)
    moved = gateway.metric("dsv4_gateway_stream_migrations_total", outcome="continued") - moved0
    return rollout_report(args, sent, turns, moved, recomputed, flags)


def rollout_report(
    args: argparse.Namespace,
    sent: list[Sent],
    turns: list[Replaced],
    moved: float,
    recomputed: float,
    flags: list[str],
) -> int:
    failed = [s for s in sent if not s.record.ok]
    cut = [s for s in failed if "broke off" in s.record.error]
    extra = extra_latency(sent, [t.at for t in turns], moved)
    print(f"\n== chaos rollout ({' '.join(flags)}) ==")
    print(f"engines replaced:   {len(turns)}")
    print(f"streams:            {len(sent)} of {args.output_len} tokens, {args.streams} at once")
    print(f"  failed:           {len(failed) - len(cut)}  (goal 0)")
    print(f"  cut:              {len(cut)}  (goal 0)")
    print(f"  moved:            {moved:g}")
    print(f"extra latency of moved streams: p50 {pct(extra, 0.5):.3f}s p99 {pct(extra, 0.99):.3f}s")
    for t in turns:
        remaining = max((s.end - t.at for s in sent if s.start <= t.at <= s.end), default=0.0)
        print(
            f"  {t.name}: drain {t.drain_s:.3f}s (the longest remaining generation: "
            f"{remaining:.3f}s), back and routed {t.ready_s:.1f}s later; "
            f"asked to move {t.answer.get('migrating')} of {t.answer.get('in_flight')}, "
            f"{t.sent_bytes / 1e6:.2f} MB of KV sent meanwhile"
        )
    print(f"decode requests recomputed (failed or refused KV pull): {recomputed:g}")
    for s in failed[:3]:
        print(f"  e.g. {s.record.error[:160]}")
    return 1 if failed else 0
