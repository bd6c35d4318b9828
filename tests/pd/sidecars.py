"""Real ``dsv4 kv-sidecar`` processes on 127.0.0.1 for the pd tier (``SidecarService``, the
one way sidecars are started), each with the client an engine's connector uses."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from pathlib import Path

from dsv4_common.config_cli import given
from dsv4_common.process import free_ports
from dsv4_kvtransfer import cli
from dsv4_kvtransfer.client import SidecarClient
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.launch import SidecarService

SHM_DIR = "/dev/shm"


class SidecarProc(SidecarService):
    """A started sidecar, its staging region's name and a client of its control API."""

    def __init__(
        self, name: str, log_path: Path, token_file: Path, port: int, **settings: object
    ) -> None:
        super().__init__(name, log_path, token_file, port, **settings)
        self.shm_name = str(settings["shm_name"])
        self.client = SidecarClient(self.url)

    @property
    def control_url(self) -> str:
        return self.url

    def info(self) -> dict[str, object]:
        return self.client.info()

    def free_bytes(self) -> int:
        return int(self.client.info()["free_bytes"])

    def alive(self) -> bool:
        return self.running()

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as after an OOM kill."""
        if self.running() and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        self.stop()


class SidecarFactory:
    """Starts sidecars; the fixture's finalizer kills every one and unlinks its region."""

    def __init__(self, tmp: Path, tag: str) -> None:
        self.tmp = tmp
        self.tag = tag
        self.token_file = tmp / "token"
        self.token_file.write_text("a-shared-secret-for-the-pd-tests-0123456789\n")
        self.procs: list[SidecarProc] = []
        self._ports: set[int] = set()

    def token(self, text: str) -> Path:
        p = self.tmp / f"token-{len(text)}-{abs(hash(text)) % 10**8}"
        p.write_text(text)
        return p

    def start(
        self,
        *flags: str,
        token_file: Path | None = None,
        staging: str = "128M",
        lease: float = 30.0,
        shm_name: str | None = None,
        **settings: object,
    ) -> SidecarProc:
        """A sidecar with these settings; ``flags`` are ``dsv4 kv-sidecar`` flags, read by its
        own parser (``--control-port P`` keeps an engine's URL across a restart)."""
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        settings = {**given(SidecarConfig, parser.parse_args(list(flags))), **settings}
        name = f"s{len(self.procs) + 1}"
        # peer, control and metrics ports: three in a row, as a pod has them
        sc = SidecarProc(
            name,
            self.tmp / f"{name}.log",
            token_file or self.token_file,
            free_ports(3, self._ports),
            staging_bytes=staging,
            lease_seconds=lease,
            shm_name=shm_name or f"dsv4-kv-test-{self.tag}-{name}",
            **settings,
        )
        self.procs.append(sc)
        sc.start()
        sc.wait_ready(30)
        return sc

    def close(self) -> None:
        for sc in self.procs:
            sc.client.close()
            sc.kill()  # its stop removes the region and socket it left

    def failure_report(self) -> str:
        return "\n".join(f"--- sidecar {sc.name} ---\n{sc.tail(60)}" for sc in self.procs)
