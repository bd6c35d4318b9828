"""Child processes that never outlive their parent, each with its own log file."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Linux: the kernel sends SIGKILL to the child when the parent thread exits, so a crashed or
    # killed test run leaves no orphaned etcd/apiserver behind.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
                preexec_fn=_die_with_parent,
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
