"""The operator as a real process against the test control plane."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from dsv4_common.process import ManagedProcess, free_port
from tests.helpers import wait_for


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log_dir: Path, extra: list[str] | None = None) -> None:
        self.metrics_port = free_port()
        self.health_port = free_port()
        argv = [
            sys.executable,
            "-m",
            "dsv4_common.cli",
            "operator",
            "--kubeconfig",
            str(kubeconfig),
            "--health-port",
            str(self.health_port),
            "--metrics-port",
            str(self.metrics_port),
            *(extra or []),
        ]
        self.proc = ManagedProcess("operator", argv, log_dir / f"operator-{self.metrics_port}.log")

    def start(self) -> OperatorProcess:
        self.proc.start(env={"PYTHONUNBUFFERED": "1"})
        wait_for("the operator's liveness endpoint", self.healthy, timeout_s=60)
        return self

    def healthy(self) -> bool:
        if not self.proc.running():
            raise AssertionError(f"operator exited {self.proc.exit_code()}:\n{self.proc.tail(60)}")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.health_port}/healthz", timeout=2
            ) as r:
                return int(r.status) == 200
        except OSError:
            return False

    def metric(self, name: str) -> float:
        """Sum of all samples of a Prometheus metric (0 when absent)."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                key = line.split(" ")[0].split("{")[0]
                if key == name:
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        self.proc.stop()

    def tail(self, lines: int = 60) -> str:
        return self.proc.tail(lines)

    def failure_report(self) -> str:
        return f"----- operator {self.proc.log_path}\n{self.tail(80)}"


def kubectl_json(cluster: Any, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cluster.kubectl(*args, "-o", "json"))
    return out


def apply_yaml(cluster: Any, text: str, namespace: str) -> str:
    return str(cluster.kubectl("apply", "-n", namespace, "-f", "-", input=text))


def run_ok(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=True, **kw)
