"""Real processes on 127.0.0.1: engines (dsv4-tiny, dummy weights) and gateways in front of them."""

from __future__ import annotations

import contextlib
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsv4_common.process import ManagedProcess, free_port

LOG_DIR = Path(tempfile.gettempdir()) / "dsv4-test-gateway"


class Service:
    """One `dsv4 <subcommand>` process with a port, a log and a readiness wait."""

    def __init__(self, name: str, subcommand: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "dsv4_common.cli",
            *subcommand,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.proc = ManagedProcess(name, argv, LOG_DIR / f"{name}-{self.port}.log")

    def launch(self) -> Service:
        self.proc.start(env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        return self

    def start(self, timeout_s: float = 120.0) -> Service:
        return self.launch().wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 120.0) -> Service:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.proc.running():
                raise RuntimeError(
                    f"{self.proc.name} exited {self.proc.exit_code()}:\n{self.proc.tail(40)}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(
            f"{self.proc.name} not healthy after {timeout_s}s:\n{self.proc.tail(40)}"
        )

    def stop(self) -> None:
        self.proc.stop()

    def failure_report(self) -> str:
        return f"----- {self.proc.name} {self.proc.log_path}\n{self.proc.tail(40)}"


def engine(name: str, *extra: str) -> Service:
    return Service(
        name,
        [
            "engine",
            "--model",
            "dsv4-tiny",
            "--load-format",
            "dummy",
            "--dtype",
            "float32",
            "--seed",
            "0",
            *extra,
        ],
    )


def gateway(name: str, *args: str) -> Service:
    return Service(name, ["gateway", "--health-interval", "0.5", "--log-level", "warning", *args])


class Stack:
    def __init__(self, services: list[Service]) -> None:
        self.services = services

    def failure_report(self) -> str:
        return "\n".join(s.failure_report() for s in self.services)

    def stop(self) -> None:
        for s in reversed(self.services):
            s.stop()


@pytest.fixture(scope="module")
def two_engines() -> Iterator[tuple[Service, Service]]:
    a, b = engine("engine-a"), engine("engine-b")
    with running(a, b):
        yield a, b


def routed_counts(gateway_url: str) -> dict[str, float]:
    """dsv4_gateway_routed_total per instance URL, from the gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{gateway_url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "dsv4_gateway_routed_total":
                out[s.labels["instance"]] = out.get(s.labels["instance"], 0.0) + s.value
    return out


class SidecarService(Service):
    """`dsv4 kv-sidecar` for an engine; healthy when its metrics listener answers /health."""

    def __init__(self, name: str, engine_port: int, token_file: Path) -> None:
        base = free_port()
        self.kv_port, self.control_port, self.metrics_port = base, free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.metrics_port}"
        self.port = self.metrics_port
        argv = [
            sys.executable, "-m", "dsv4_common.cli", "kv-sidecar", "--transport", "tcp",
            "--host", "127.0.0.1", "--port", str(self.kv_port), "--control-port", str(self.control_port),
            "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1",
            "--engine-url", f"http://127.0.0.1:{engine_port}", "--auth-token-file", str(token_file),
            "--shm-name", f"dsv4-test-{name}-{base}", "--staging-bytes", str(64 << 20),
        ]  # fmt: skip
        self.proc = ManagedProcess(name, argv, LOG_DIR / f"{name}-{base}.log")


@contextlib.contextmanager
def running(*services: Service, timeout_s: float = 180.0) -> Iterator[tuple[Service, ...]]:
    """Launch all (they load in parallel), wait until each is healthy, stop all on the way out."""
    try:
        for s in services:
            s.launch()
        for s in services:
            s.wait_ready(timeout_s)
        yield services
    finally:
        for s in reversed(services):
            s.stop()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """The KV sidecars' shared secret."""
    path = tmp_path / "kv-token"
    path.write_text(secrets.token_urlsafe(24))
    return path


def pd_pair(
    name: str, role: str, token_file: Path, *engine_args: str
) -> tuple[SidecarService, Service]:
    """A sidecar and its engine (not started)."""
    eng = engine(name, "--role", role, *engine_args)
    side = SidecarService(f"{name}-sidecar", eng.port, token_file)
    eng.proc.argv += ["--kv-sidecar", f"http://127.0.0.1:{side.control_port}"]
    return side, eng
