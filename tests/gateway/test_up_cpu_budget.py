"""``dsv4 up --decode 2`` (three engines, their sidecars and the gateway) runs every process in
the CPU share it planned: read back from /proc, not from the plan."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import openai

from dsv4_common.cli import build_parser
from dsv4_common.process import Service, dsv4_argv, free_port
from dsv4_serving.commands import up
from dsv4_serving.platform.threads import parse_cpu_list
from tests.gateway.conftest import LOG_DIR

# An engine core's own threads besides torch's intra-op workers, by role: its main thread and
# its result queue's feeder thread, the async scheduler's step thread (async is on for
# dsv4-tiny's MTP; it starts with the engine's first step, and the one request below reaches
# one of the two decode engines only), and a prefill engine's KV exporter thread (a decode
# engine's pulls run on threads that end with the pull). torch's pool adds (intra-op threads
# - 1) workers; without the budget, two CPUs give a core two more threads than this.
CORE_THREADS = {"prefill": (4,), "decode": (2, 3)}


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


def _tree(pid: int) -> list[int]:
    return [pid, *(p for c in _children(pid) for p in _tree(c))]


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(i.split("=", 1) for i in items if "=" in i)


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _name(argv: list[str]) -> str:
    """The ``dsv4 up`` process name of a child's command line (its log file says it too)."""
    if "kv-sidecar" in argv:
        return argv[argv.index("--sidecar-id") + 1]
    if "gateway" in argv:
        return "gateway"
    return "engine"


def test_up_decode_2_runs_each_process_in_its_planned_share() -> None:
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="dsv4-up-budget-"))
    stack = Service(
        "dsv4-up",
        dsv4_argv(
            "up",
            *("--decode", "2", "--port", str(port), "--log-dir", str(log_dir)),
            *("--startup-timeout", "600"),
        ),
        LOG_DIR / f"dsv4-up-budget-{port}.log",
        f"http://127.0.0.1:{port}",
    )
    stack.start(env={"PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 660  # seven processes on a busy host
        while "dsv4 is up" not in stack.tail(80):
            assert stack.running() and time.monotonic() < deadline, stack.tail(80)
            time.sleep(0.5)
        # one request through prefill and decode: every engine's torch pool is in use
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="dsv4-tiny", prompt="hello world", max_tokens=8)
        assert r.usage is not None and r.usage.completion_tokens >= 1
        _check_shares(stack, port)
    finally:
        stack.stop(timeout_s=60)


def _check_shares(stack: Service, port: int) -> None:
    args = build_parser().parse_args(["up", "--decode", "2", "--port", str(port)])
    shares = up.cpu_shares(args)
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    assert stack.pid is not None
    log_dir = Path(stack.argv[stack.argv.index("--log-dir") + 1])
    seen: list[str] = []
    for pid in _children(stack.pid):
        argv = _cmdline(pid)
        assert "share_exec" not in " ".join(argv), "the wrapper execs into the command"
        name = _name(argv)
        if name == "engine":  # which one: its log file is named after it and its port
            eport = argv[argv.index("--port") + 1]
            name = next(n for n in shares if (log_dir / f"{n}-{eport}.log").exists())
        share = shares[name]
        seen.append(name)
        env, status = _environ(pid), _status(pid)
        for key, value in share.env.items():
            assert env.get(key) == value, (name, key)
        assert parse_cpu_list(status["Cpus_allowed_list"]) == (share.cpus or allowed), name
        if share.kind != "engine":
            continue
        assert argv[argv.index("--threads-per-rank") + 1] == str(share.threads)
        cores = [p for p in _tree(pid) if "multiprocessing.spawn" in " ".join(_cmdline(p))]
        assert len(cores) == 1, (name, cores)
        threads = int(_status(cores[0])["Threads"])
        assert share.threads is not None
        role = argv[argv.index("--role") + 1]
        assert threads - (share.threads - 1) in CORE_THREADS[role], (name, threads, share)
    assert sorted(seen) == sorted(shares)
