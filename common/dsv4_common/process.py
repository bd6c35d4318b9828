"""Child processes that never outlive their parent, each with its own log file; a ``Service``
is one with an HTTP health URL and Prometheus metrics. The one process helper of the project:
``dsv4 up``, the dev cluster, the tests and the benchmarks all start processes through it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Self

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    # Linux: the kernel sends SIGKILL to the child when the parent thread exits, so a crashed or
    # killed test run leaves no orphaned etcd/apiserver behind.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


PORT_RANGE_ENV = "DSV4_PORT_RANGE"
"""``LO-HI``: the ports this process and its children pick from (``free_port`` the lower two
thirds, ``free_port_below_ephemeral`` the rest), so that test runs side by side
(``scripts/test-side-by-side``) never pick the same port; unset, the OS picks."""

_handed_out: list[int] = []  # this process's last picks, not handed out again soon
_REMEMBERED = 256


def port_range(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """``DSV4_PORT_RANGE`` as (lo, hi), both included; None when unset. A malformed value is an
    error naming the variable (silently ignoring it would bring back the collisions)."""
    raw = env.get(PORT_RANGE_ENV, "").strip()
    if not raw:
        return None
    lo_s, sep, hi_s = raw.partition("-")
    if not sep or not lo_s.isdigit() or not hi_s.isdigit():
        raise ValueError(f"{PORT_RANGE_ENV} must be LO-HI, got {raw!r}")
    lo, hi = int(lo_s), int(hi_s)
    if lo < 1024 or not lo + 30 <= hi <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV} must be 30+ ports within 1024-65535, got {raw!r}")
    return lo, hi


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick(lo: int, hi: int) -> int | None:
    """A free port of [lo, hi) not handed out lately by this process."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(lo, hi)
        if port not in _handed_out and _bindable(port):
            _handed_out.append(port)
            del _handed_out[:-_REMEMBERED]
            return port
    return None


def _split(span: tuple[int, int]) -> int:
    lo, hi = span
    return lo + 2 * (hi + 1 - lo) // 3


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    span = port_range()
    if span is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            chosen: int = s.getsockname()[1]
            return chosen
    port = _pick(span[0], _split(span))
    if port is None:
        raise RuntimeError(f"no free port in the lower part of {PORT_RANGE_ENV} {span}")
    return port


def ephemeral_range() -> tuple[int, int]:
    """The ports the OS hands out for a bind to port 0 (Linux's ip_local_port_range)."""
    try:
        lo, hi = (
            int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        )
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port_below_ephemeral() -> int:
    """A free port below the ephemeral range, for a process that picks a port for itself while
    others (tests, ``dsv4 up``) pick theirs with ``free_port`` and bind them only later: ports
    from the two pickers can never be the same (under ``DSV4_PORT_RANGE``: its upper third)."""
    span = port_range()
    if span is not None:
        lo, hi = _split(span), span[1] + 1
    else:
        top = ephemeral_range()[0]
        lo, hi = max(1024, top - 12000), top
    port = _pick(lo, hi)
    return port if port is not None else free_port()


def free_ports(n: int, taken: set[int]) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1, none of them in ``taken``
    (which it extends: nothing listens on them yet, so the OS alone would hand out overlaps)."""
    span = port_range()
    top = 65536 if span is None else _split(span)  # within free_port's part of the range
    for _ in range(200):
        base = free_port()
        ports = range(base, base + n)
        if base + n > top or taken & set(ports) or set(ports[1:]) & set(_handed_out):
            continue
        if all(_bindable(p) for p in ports[1:]):
            taken.update(ports)
            _handed_out.extend(ports[1:])
            return base
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


def dsv4_argv(*args: str) -> list[str]:
    """The ``dsv4`` command run by this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "dsv4_common.cli", *args]


class ManagedProcess:
    """One long-running binary with stdout and stderr captured to ``log_path``."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def exit_code(self) -> int | None:
        """None while running (or never started), else the exit status."""
        return self._proc.poll() if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the whole process group, wait for the leader, then SIGKILL whatever of the
        group is left: children (an engine's workers) can outlive a leader that already exited."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout_s)

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Service(ManagedProcess):
    """A process that serves HTTP: healthy when ``GET {url}/health`` answers 200; its
    Prometheus samples read with ``metric``."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, url: str, health_path: str = "/health"
    ) -> None:
        super().__init__(name, argv, log_path)
        self.url = url.rstrip("/")
        self.health_url = self.url + health_path

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as r:
                return int(r.status) == 200
        except (OSError, ValueError, urllib.error.HTTPError):
            return False

    def wait_ready(self, timeout_s: float = 120.0) -> Self:
        """Until healthy; an exit or the deadline raises with the log's tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(f"{self.name} exited {self.exit_code()}:\n{self.tail(40)}")
            if self.healthy():
                return self
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s}s:\n{self.tail(40)}")

    def metrics_text(self, path: str = "/metrics") -> str:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            text: str = r.read().decode()
            return text

    def metric(self, name: str, path: str = "/metrics", **labels: str) -> float:
        """The sum of the samples named ``name`` whose labels include ``labels`` (0 if none)."""
        return metric_value(self.metrics_text(path), name, **labels)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples ``name`` in Prometheus text ``text`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
