"""``dsv4 up``: the whole stack on this machine, on the built-in tiny model.

A gateway on 127.0.0.1:8000, one prefill and one decode engine, each with its KV sidecar
(``--no-pd``: ``--decode N`` engines doing both, no sidecars), started in dependency order, checked healthy, and stopped together on Ctrl-C (or when any of
them dies: its log tail is printed). Process supervision only; every piece is the real command.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dsv4_common.process import Service, dsv4_argv, free_ports
from dsv4_kvtransfer.config import MIN_DISK_BYTES, parse_size
from dsv4_serving.commands.launch import engine_service, engine_with_sidecar, in_share
from dsv4_serving.platform.threads import (
    MODES,
    ProcessKind,
    ProcessShare,
    openmp_runtime,
    plan_cpus,
)

STAGING_BYTES = 256 << 20  # each sidecar's region


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="dsv4-tiny", help="preset or checkpoint directory (default dsv4-tiny)"
    )
    p.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    # default None: ``--no-pd`` refuses an explicit --prefill rather than ignore it
    p.add_argument("--prefill", type=int, default=None, help="prefill engines (default 1)")
    p.add_argument(
        "--decode",
        type=int,
        default=None,
        help="decode engines (default 1); with --no-pd, engines doing both",
    )
    p.add_argument(
        "--no-pd",
        action="store_true",
        help="engines doing both (--decode N of them, default 1), no sidecars",
    )
    p.add_argument(
        "--kv-transport",
        choices=["tcp", "shm"],
        default="tcp",
        help="how decode pulls KV (default tcp)",
    )
    p.add_argument(
        "--kv-host-bytes",
        type=parse_size,
        default=0,
        metavar="SIZE",
        help="each sidecar's host tier of offered prefixes (e.g. 64M; at most its 256M staging "
        "region; default 0: off)",
    )
    p.add_argument(
        "--kv-disk-bytes",
        type=parse_size,
        default=0,
        metavar="SIZE",
        help="each sidecar's disk tier under its host tier (e.g. 1G; needs --kv-host-bytes), "
        "its files under the log directory (default 0: off)",
    )
    p.add_argument(
        "--load-format",
        default="dummy",
        help="engine --load-format (default dummy: random weights)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra engine argument (repeatable)",
    )
    for role, who in (
        ("prefill", "prefill engines only (e.g. --prefill-arg=--tensor-parallel-size=2)"),
        ("decode", "decode engines only (with --no-pd: the engines doing both)"),
    ):
        p.add_argument(
            f"--{role}-arg",
            action="append",
            default=[],
            metavar="ARG",
            help=f"extra engine argument for {who}; after --engine-arg (repeatable)",
        )
    p.add_argument(
        "--log-dir", type=Path, default=None, help="where each process logs (default: a temp dir)"
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="trace every request across gateway, engines and sidecars to this OTLP/HTTP "
        "endpoint (e.g. http://127.0.0.1:4318; default: tracing off)",
    )
    p.add_argument(
        "--cpu-budget",
        choices=MODES,
        default="auto",
        help="how the processes share this host's CPUs: auto (default) gives each engine its "
        "own CPUs when there are at least as many CPUs as engines, else shared; shared: an "
        "explicit thread count each and OpenMP's passive wait, no pinning; off: each process "
        "sizes its threads to the whole host (engine flags given with --engine-arg, e.g. "
        "--threads-per-rank, override the budget)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the processes, their commands and CPU shares, and start nothing",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds for everything to become healthy",
    )


def _exited(c: Service) -> str:
    return f"\n{c.name} exited with status {c.exit_code()}; its log ({c.log_path}):\n{c.tail(30)}"


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def check_counts(args: argparse.Namespace) -> None:
    """Engine counts a user can mean, or a CLI error naming the flag: ``--no-pd`` has no
    prefill engines (``--decode N`` counts its engines doing both)."""
    if args.no_pd and args.prefill is not None:
        raise SystemExit(
            "dsv4 up: error: --prefill has no meaning with --no-pd (no prefill engines); "
            "use --decode N for N engines doing both"
        )
    for flag, value in (("--prefill", args.prefill), ("--decode", args.decode)):
        if value is not None and value < 1:
            raise SystemExit(f"dsv4 up: error: {flag} must be >= 1, got {value}")
    if args.no_pd and args.prefill_arg:
        raise SystemExit(
            "dsv4 up: error: --prefill-arg has no meaning with --no-pd (no prefill engines); "
            "use --engine-arg or --decode-arg"
        )


def check_tiers(args: argparse.Namespace) -> None:
    """The sidecars' host and disk tiers, or a CLI error naming the flag."""
    host, disk = args.kv_host_bytes, args.kv_disk_bytes
    for flag, value in (("--kv-host-bytes", host), ("--kv-disk-bytes", disk)):
        if value and args.no_pd:
            raise SystemExit(f"dsv4 up: error: {flag} has no meaning with --no-pd (no sidecars)")
    if host > STAGING_BYTES:
        raise SystemExit(
            f"dsv4 up: error: --kv-host-bytes must be at most the sidecars' staging region "
            f"({STAGING_BYTES} bytes), got {host}"
        )
    if disk and disk < MIN_DISK_BYTES:
        raise SystemExit(
            f"dsv4 up: error: --kv-disk-bytes must be 0 (off) or at least 1M, got {disk}"
        )
    if disk and not host:
        raise SystemExit("dsv4 up: error: --kv-disk-bytes needs --kv-host-bytes")


def _tiers(args: argparse.Namespace, run_dir: Path, name: str) -> dict[str, object]:
    """The sidecar settings of ``name``'s tiers (none when off)."""
    out: dict[str, object] = {}
    if args.kv_host_bytes:
        out["kv_host_bytes"] = args.kv_host_bytes
    if args.kv_disk_bytes:
        out.update(kv_disk_bytes=args.kv_disk_bytes, kv_disk_dir=str(run_dir / f"{name}-kv-disk"))
    return out


def _count(value: int | None) -> int:
    return 1 if value is None else value


def _roles(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(process name, engine role) of every engine: ``engine-<i>`` (both) with ``--no-pd``,
    else ``prefill-<i>`` and ``decode-<i>``."""
    if args.no_pd:
        return [(f"engine-{i}", "both") for i in range(_count(args.decode))]
    return [
        *((f"prefill-{i}", "prefill") for i in range(_count(args.prefill))),
        *((f"decode-{i}", "decode") for i in range(_count(args.decode))),
    ]


def processes(args: argparse.Namespace) -> list[tuple[str, ProcessKind]]:
    """(name, kind) of every process ``plan`` starts, for the CPU budget."""
    out: list[tuple[str, ProcessKind]] = []
    for name, role in _roles(args):
        if role != "both":
            out.append((f"{name}-sidecar", "sidecar"))
        out.append((name, "engine"))
    return [*out, ("gateway", "gateway")]


def cpu_shares(args: argparse.Namespace) -> dict[str, ProcessShare]:
    """Each process's share of the CPUs this process may run on (a container's cpuset)."""
    cpus = sorted(os.sched_getaffinity(0))
    shares = plan_cpus(cpus, processes(args), args.cpu_budget, openmp_runtime())
    return {s.name: s for s in shares}


def plan(args: argparse.Namespace, run_dir: Path) -> list[Service]:
    """The processes, in start order (sidecars, engines, gateway), each in its CPU share."""
    shares = cpu_shares(args)
    taken: set[int] = {args.port}
    token = run_dir / "kv-token"
    token.write_text(secrets.token_urlsafe(32))
    token.chmod(0o600)
    model = ["--model", args.model, "--load-format", args.load_format]
    traced: dict[str, str] = {}  # the flag every process gets when tracing is on
    if args.otlp_traces_endpoint:
        traced = {"otlp_traces_endpoint": args.otlp_traces_endpoint}
        model += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    children: list[Service] = []
    gateway_args: list[str] = []
    for name, role in _roles(args):
        own = args.prefill_arg if role == "prefill" else args.decode_arg
        engine_args = [*shares[name].engine_args(), *args.engine_arg, *own]
        if role == "both":
            port = free_ports(1, taken)
            engine = in_share(
                engine_service(name, model, port, run_dir, *engine_args), shares[name]
            )
            children.append(engine)
            gateway_args += ["--engine", engine.url]
            continue
        pair = engine_with_sidecar(
            name,
            role,
            model,
            log_dir=run_dir,
            token_file=token,
            taken=taken,
            shm_prefix=f"dsv4-up-{os.getpid()}",
            engine_args=engine_args,
            transport=args.kv_transport,
            staging_bytes=STAGING_BYTES,
            **_tiers(args, run_dir, name),
            **traced,
        )
        children += [
            in_share(pair.sidecar, shares[pair.sidecar.name]),
            in_share(pair.engine, shares[name]),
        ]
        gateway_args += [f"--{role}", pair.engine.url]
    children.append(in_share(_gateway(args, run_dir, gateway_args), shares["gateway"]))
    return children


def describe(args: argparse.Namespace, children: list[Service]) -> str:
    """The plan as ``--dry-run`` prints it: each process's CPU share and command."""
    shares = cpu_shares(args)
    cpus = sorted(os.sched_getaffinity(0))
    lines = [f"{len(children)} processes on {len(cpus)} CPUs (--cpu-budget {args.cpu_budget}):"]
    for c in children:
        lines += [f"  {shares[c.name].describe()}", f"    {' '.join(c.argv)}"]
    return "\n".join(lines)


def _gateway(args: argparse.Namespace, run_dir: Path, upstreams: list[str]) -> Service:
    traced = ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    return Service(
        "gateway",
        dsv4_argv(
            "gateway",
            *("--host", args.host, "--port", str(args.port), "--log-level", "warning"),
            *(traced if args.otlp_traces_endpoint else []),
            # chat prefix hashes over the engines' own prompt ids (docs/gateway.md)
            *("--tokenizer", args.model, *_rendering_flags(args.engine_arg)),
            *upstreams,
        ),
        run_dir / "gateway.log",
        f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}",
    )


def _rendering_flags(engine_args: list[str]) -> list[str]:
    """The engines' chat-rendering flags, which the gateway must render with too."""
    out: list[str] = []
    for i, a in enumerate(engine_args):
        for flag in ("--chat-format", "--default-thinking"):
            if a.startswith(flag + "="):
                out.append(a)
            elif a == flag and i + 1 < len(engine_args):
                out += [a, engine_args[i + 1]]
    return out


def _shape(args: argparse.Namespace) -> str:
    if args.no_pd:
        n = _count(args.decode)
        return "one engine" if n == 1 else f"{n} engines, no PD"
    return (
        f"{_count(args.prefill)} prefill + {_count(args.decode)} decode, "
        f"KV over {args.kv_transport}"
    )


class StartFailed(RuntimeError):
    """A process exited or did not become healthy in time; the message has its log tail."""


def start_in_order(
    children: list[Service],
    timeout_s: float,
    stop: threading.Event | None = None,
    ready: Callable[[Service], None] = lambda c: None,
) -> bool:
    """Start sidecars first, engines next (they load in parallel), the gateway last, each group
    healthy before the next; False if ``stop`` was set meanwhile. Raises ``StartFailed``."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    for group in (
        [c for c in children if c.name.endswith("sidecar")],
        [c for c in children if not c.name.endswith("sidecar") and c.name != "gateway"],
        [c for c in children if c.name == "gateway"],
    ):
        for c in group:
            c.start(env={"PYTHONUNBUFFERED": "1"})
        pending = list(group)
        while pending:
            if stop.is_set():
                return False
            for c in list(pending):
                if not c.running():
                    raise StartFailed(_exited(c))
                if c.healthy():
                    ready(c)
                    pending.remove(c)
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise StartFailed(
                    f"\n{names} not healthy after {timeout_s:.0f}s; last log lines:\n"
                    + "\n".join(c.tail(15) for c in pending)
                )
            time.sleep(0.3)
    return True


def restart(child: Service, timeout_s: float = 120.0) -> None:
    """The restart hook (``benchmarks/chaos.py``): start ``child`` again with the same command
    line (same ports, same staging region name) and wait until it is healthy."""
    if child.running():
        child.stop(timeout_s=15.0)
    start_in_order([child], timeout_s)


def run(args: argparse.Namespace) -> int:
    check_counts(args)
    check_tiers(args)
    if not 0 < args.port < 65536:
        raise SystemExit(f"dsv4 up: error: --port must be in 1..65535, got {args.port}")
    if not _port_free(args.host, args.port):
        raise SystemExit(
            f"dsv4 up: error: {args.host}:{args.port} is in use; pick another with --port"
        )
    run_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="dsv4-up-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    children = plan(args, run_dir)
    if args.dry_run:
        print(describe(args, children))
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def shutdown() -> None:
        print("stopping ...", flush=True)
        for child in reversed(children):
            child.stop(timeout_s=15.0)
        print("stopped.", flush=True)

    def supervise() -> int:
        shares = cpu_shares(args)
        print(f"starting {len(children)} processes (logs in {run_dir}) ...", flush=True)
        print("\n".join(f"  {shares[c.name].describe()}" for c in children), flush=True)
        try:
            started = start_in_order(
                children,
                args.startup_timeout,
                stop,
                lambda c: print(f"  {c.name} ready", flush=True),
            )
        except StartFailed as e:
            print(e, file=sys.stderr)
            return 1
        if not started:
            return 130

        url = f"http://{args.host}:{args.port}"
        model = Path(args.model).name if os.sep in args.model else args.model
        print(
            f"\ndsv4 is up: {url}  (model {model}; {_shape(args)})\n\n"
            f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\\n"
            f'       -d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}\'\n\n'
            "Ctrl-C stops everything.",
            flush=True,
        )
        while not stop.wait(1.0):
            for c in children:
                if not c.running():
                    print(_exited(c), file=sys.stderr)
                    return 1
        return 0

    try:
        return supervise()
    finally:  # whatever ended it (Ctrl-C, a dead child, an exception): stop every child
        shutdown()
