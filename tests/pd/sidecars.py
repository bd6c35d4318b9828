"""Real ``dsv4 kv-sidecar`` processes on 127.0.0.1 for the pd tier, and an engine stand-in that
writes and reads KV buffers through the sidecar's client, as the engine's connector will."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dsv4_kvtransfer.client import SidecarClient

SHM_DIR = "/dev/shm"


@dataclass
class SidecarProc:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    control_port: int
    shm_name: str
    log_path: Path
    ready: dict[str, object] = field(default_factory=dict)
    client: SidecarClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = SidecarClient(f"http://127.0.0.1:{self.control_port}")

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    def info(self) -> dict[str, object]:
        return self.client.info()

    def free_bytes(self) -> int:
        return int(self.client.info()["free_bytes"])  # type: ignore[call-overload]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.control_url + "/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample (0 if absent), labels matched exactly."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in self.metrics().splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = ",".join(sorted((m.group(3) or "").split(","))) if m.group(3) else ""
            if got == want:
                return float(m.group(4))
        return 0.0

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> int:
        """SIGTERM and wait: the sidecar unlinks its region and exits 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return int(self.proc.returncode)


class SidecarFactory:
    """Starts sidecars; the fixture's finalizer kills every one and unlinks its region."""

    def __init__(self, tmp: Path, tag: str) -> None:
        self.tmp = tmp
        self.tag = tag
        self.token_file = tmp / "token"
        self.token_file.write_text("a-shared-secret-for-the-pd-tests-0123456789\n")
        self.procs: list[SidecarProc] = []
        self.n = 0

    def token(self, text: str) -> Path:
        p = self.tmp / f"token-{len(text)}-{abs(hash(text)) % 10**8}"
        p.write_text(text)
        return p

    def start(
        self,
        *extra: str,
        transport: str = "tcp",
        token_file: Path | None = None,
        staging: str = "128M",
        lease: float = 30.0,
        shm_name: str | None = None,
    ) -> SidecarProc:
        self.n += 1
        name = f"s{self.n}"
        shm = shm_name or f"dsv4-kv-test-{self.tag}-{name}"
        ready = self.tmp / f"{name}.ready"
        log_path = self.tmp / f"{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "dsv4_common.cli",
            "kv-sidecar",
            "--transport",
            transport,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--control-port",
            "0",
            "--auth-token-file",
            str(token_file or self.token_file),
            "--staging-bytes",
            staging,
            "--lease-seconds",
            str(lease),
            "--shm-name",
            shm,
            "--sidecar-id",
            name,
            "--ready-file",
            str(ready),
            *extra,
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise AssertionError(
                    f"sidecar {name} did not start: {log_path.read_text(errors='replace')}"
                )
            time.sleep(0.02)
        r = json.loads(ready.read_text())
        sc = SidecarProc(name, proc, r["port"], r["control_port"], r["shm_name"], log_path, r)
        self.procs.append(sc)
        return sc

    def close(self) -> None:
        for sc in self.procs:
            sc.client.close()
            sc.kill()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, sc.shm_name))

    def failure_report(self) -> str:
        return "\n".join(f"--- sidecar {sc.name} ---\n{sc.log()}" for sc in self.procs)
