"""The processes real nodes run on this host: each recorded in the host-state ledger before it
can change anything (the next run kills what a crashed one left), and waits that fail with their
logs."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dsv4_common.process import ManagedProcess
from dsv4_devcluster.realnodes.hoststate import Ledger
from dsv4_devcluster.realnodes.node import RealNodeError


@dataclass
class Supervisor:
    work_dir: Path
    ledger: Ledger
    startup_timeout_s: float
    processes: list[ManagedProcess] = field(default_factory=list)

    def spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.work_dir / "logs" / f"{name}.log")
        proc.start()
        self.processes.append(proc)
        assert proc.pid is not None
        self.ledger.add_pid(proc.pid)
        return proc

    def check_alive(self) -> None:
        dead = [p for p in self.processes if not p.running()]
        if dead:
            raise RealNodeError(
                f"{', '.join(p.name for p in dead)} exited:\n"
                + "\n".join(f"--- {p.name}\n{p.tail(40)}" for p in dead)
            )

    def wait(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready():
            self.check_alive()
            if time.monotonic() > deadline:
                raise RealNodeError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, lines: int = 30) -> str:
        return "\n".join(
            f"----- {p.name} (pid {p.pid}, exit {p.exit_code()}) {p.log_path}\n{p.tail(lines)}"
            for p in self.processes
        )

    def stop(self) -> None:
        """Every process, newest first."""
        for proc in reversed(self.processes):
            proc.stop(timeout_s=15)
