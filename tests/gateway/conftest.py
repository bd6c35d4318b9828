"""Real processes on 127.0.0.1: engines (dsv4-tiny, dummy weights), KV sidecars and gateways in
front of them, each a ``dsv4_common.process.Service``."""

from __future__ import annotations

import contextlib
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsv4_common.process import Service, dsv4_argv, free_port
from dsv4_kvtransfer.launch import SidecarService
from dsv4_serving.commands.launch import TINY_ENGINE, engine_with_sidecar

LOG_DIR = Path(tempfile.gettempdir()) / "dsv4-test-gateway"
_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
_PD_PORTS: set[int] = set()  # an engine and its sidecar take 4 consecutive ports: no overlaps


def dsv4_service(name: str, *subcommand: str) -> Service:
    """``dsv4 <subcommand> --host 127.0.0.1 --port P`` on a free port (not started)."""
    port = free_port()
    argv = dsv4_argv(*subcommand, "--host", "127.0.0.1", "--port", str(port))
    return Service(name, argv, LOG_DIR / f"{name}-{port}.log", f"http://127.0.0.1:{port}")


def engine(name: str, *extra: str) -> Service:
    return dsv4_service(name, "engine", *TINY_ENGINE, *extra)


def gateway(name: str, *args: str) -> Service:
    return dsv4_service(
        name, "gateway", "--health-interval", "0.5", "--log-level", "warning", *args
    )


@contextlib.contextmanager
def running(*services: Service, timeout_s: float = 180.0) -> Iterator[tuple[Service, ...]]:
    """Launch all (they load in parallel), wait until each is healthy, stop all on the way out."""
    try:
        for s in services:
            s.start(env=_ENV)
        for s in services:
            s.wait_ready(timeout_s)
        yield services
    finally:
        for s in reversed(services):
            s.stop()


@pytest.fixture(scope="module")
def two_engines() -> Iterator[tuple[Service, ...]]:
    with running(engine("engine-a"), engine("engine-b")) as engines:
        yield engines


def routed_counts(g: Service) -> dict[str, float]:
    """dsv4_gateway_routed_total per instance URL, from the gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(g.metrics_text()):
        for s in family.samples:
            if s.name == "dsv4_gateway_routed_total":
                out[s.labels["instance"]] = out.get(s.labels["instance"], 0.0) + s.value
    return out


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
    return engine_with_sidecar(
        name,
        role,
        TINY_ENGINE,
        log_dir=LOG_DIR,
        token_file=token_file,
        taken=_PD_PORTS,
        shm_prefix="dsv4-test",
        engine_args=engine_args,
    )
