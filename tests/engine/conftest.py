"""A real engine server process on 127.0.0.1 per module, killed in the finalizer."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineServer:
    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the server)
            prefix="dsv4-engine-", suffix=".log", delete=False
        )
        cmd = [sys.executable, "-m", "dsv4_common.cli", "engine", "--host", "127.0.0.1",
               "--port", str(self.port), *args]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited ({self.proc.returncode}):\n{self.logs()}")
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for("engine /health", up, timeout_s)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert m, f"metric {name} not exported"
        return float(m.group(1))

    def logs(self, lines: int = 40) -> str:
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])

    def failure_report(self) -> str:
        return self.logs()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def engine_server(request: pytest.FixtureRequest) -> Iterator[EngineServer]:
    args = getattr(request.module, "ENGINE_ARGS", ["--model", "dsv4-tiny"])
    server = EngineServer(args)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
