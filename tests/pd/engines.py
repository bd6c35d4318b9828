"""Real ``dsv4 engine`` processes for the pd tier (prefill, decode, both), each in its own
process group, stopped (and killed if need be) by the fixture that started them."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

COMMON = ["--load-format", "dummy", "--dtype", "float32", "--seed", "0", "--max-model-len", "512",
          "--num-kv-blocks", "900", "--max-num-seqs", "40", "--log-level", "WARNING"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProc:
    def __init__(self, name: str, log_dir: Path, *args: str) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"engine-{name}.log"
        cmd = [sys.executable, "-m", "dsv4_common.cli", "engine", "--host", "127.0.0.1",
               "--port", str(self.port), *COMMON, *args]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        self.total_blocks = 0

    def wait_ready(self, timeout_s: float = 180.0) -> EngineProc:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"engine {self.name} exited:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    # the pool's size arrives with the core's first stats message
                    self.total_blocks = int(self.metric("dsv4_kv_cache_total_blocks"))
                    if self.total_blocks:
                        return self
            time.sleep(0.2)
        raise AssertionError(f"engine {self.name} not ready after {timeout_s}s:\n{self.log()}")

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value (0 if absent); ``labels`` must all match."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(4))
        return total

    def free_blocks(self) -> int:
        return int(self.metric("dsv4_kv_cache_free_blocks"))

    def log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
