"""Starting ``dsv4 kv-sidecar`` processes: the command line from ``SidecarConfig`` settings,
and a sidecar as a ``dsv4_common.process.Service`` (the tests, the benchmark and ``dsv4 up``
start sidecars this one way)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from dsv4_common.config_cli import flag_name
from dsv4_common.ports import sidecar_control_port, sidecar_metrics_port
from dsv4_common.process import Service, dsv4_argv
from dsv4_kvtransfer.config import FAST_SUFFIX, SidecarConfig, default_shm_name

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SidecarConfig)}
_SETTINGS = frozenset(_DEFAULTS) - {"token"}


def sidecar_argv(auth_token_file: str | Path | None, **settings: object) -> list[str]:
    """``dsv4 kv-sidecar`` with one flag per ``SidecarConfig`` setting given (None: left out);
    a name that is no setting raises ``TypeError`` here, not a usage error in the child."""
    unknown = sorted(set(settings) - _SETTINGS)
    if unknown:
        raise TypeError(f"not SidecarConfig settings: {', '.join(unknown)}")
    args: list[str] = []
    if auth_token_file is not None:
        args += ["--auth-token-file", str(auth_token_file)]
    for name, value in settings.items():
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        else:
            args += [flag_name(name), str(value)]
    return dsv4_argv("kv-sidecar", *args)


class SidecarService(Service):
    """A sidecar on 127.0.0.1 whose control and metrics ports follow from its peer ``port`` as
    in a pod (unless ``settings`` name them); ready once its control API answers ``/health``."""

    def __init__(
        self,
        name: str,
        log_path: Path,
        auth_token_file: str | Path,
        port: int,
        **settings: object,
    ) -> None:
        merged: dict[str, object] = {
            "host": "127.0.0.1",
            "port": port,
            "control_port": sidecar_control_port(port),
            "metrics_host": "127.0.0.1",
            "metrics_port": sidecar_metrics_port(port),
            "sidecar_id": name,
            **settings,
        }
        self.port = port
        shm_dir = Path(str(merged.get("shm_dir") or _DEFAULTS["shm_dir"]))
        self.region = shm_dir / str(merged.get("shm_name") or default_shm_name(port))
        self.control_port = int(str(merged["control_port"]))
        self.metrics_port = int(str(merged["metrics_port"]))
        argv = sidecar_argv(auth_token_file, **merged)
        super().__init__(name, argv, log_path, f"http://127.0.0.1:{self.control_port}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop it, then remove its staging region and fast-control socket if it left them: a
        sidecar killed (SIGKILL after the stop's timeout, or by a test) cannot unlink them, and
        each holds its staging bytes of /dev/shm until the host reboots."""
        super().stop(timeout_s)
        if self.pid is not None and not self.running():
            for path in (self.region, self.region.with_name(self.region.name + FAST_SUFFIX)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
