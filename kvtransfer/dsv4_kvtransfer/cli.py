"""``dsv4 kv-sidecar``: the KV-transfer sidecar beside an engine.

One flag per ``SidecarConfig`` field (``dsv4_common.config_cli``), plus ``--auth-token-file``: the
token itself never goes on a command line. Only light modules at import time (``dsv4 kv-sidecar
--help`` builds this parser); the sidecar's own modules load inside ``run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import threading
from typing import TYPE_CHECKING, Any, NoReturn

from dsv4_common.config_cli import add_config_arguments, config_from_args, given
from dsv4_common.ports import sidecar_control_port
from dsv4_kvtransfer.config import SidecarConfig, default_shm_name, parse_size

if TYPE_CHECKING:  # the sidecar's own modules load inside ``run`` (see above)
    import logging

    from dsv4_kvtransfer.control import ControlServer
    from dsv4_kvtransfer.sidecar import Sidecar

__all__ = ["add_arguments", "derived_defaults", "parse_size", "run"]

ALIASES = {"pull_timeout_s": ["--pull-timeout"]}
# a stop that takes longer than this logs every thread's stack (the supervisor kills at 10 s)
STOP_REPORT_S = 6.0
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SidecarConfig)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, SidecarConfig, exclude=("token",), aliases=ALIASES)
    p.add_argument(
        "--auth-token-file",
        default=os.environ.get("DSV4_KV_AUTH_TOKEN_FILE"),
        help="file with the token shared by all sidecars of a deployment (>= 16 bytes); "
        "required (default $DSV4_KV_AUTH_TOKEN_FILE)",
    )


def derived_defaults(flags: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """The defaults that follow from other settings or from the pod: control port and region
    name from the peer port, the advertised address and the names from the pod's env."""
    port = int(flags.get("port", _DEFAULTS["port"]))
    host = str(flags.get("host", _DEFAULTS["host"]))
    name = env.get("POD_NAME") or socket.gethostname()
    if env.get("POD_IP"):
        advertise = env["POD_IP"]
    elif host not in ("0.0.0.0", "::", ""):
        advertise = host
    else:
        advertise = "127.0.0.1"
    return {
        "control_port": sidecar_control_port(port) if port else 0,
        "shm_name": default_shm_name(port or os.getpid()),
        "advertise_host": advertise,
        "sidecar_id": name,
        "engine_id": name,
    }


class _Refused(Exception):
    """What stops the sidecar before it serves: printed as ``error: ...``, exit status 2."""


def run(args: argparse.Namespace) -> int:
    import logging
    import sys

    try:
        cfg = _config(args)
        logging.basicConfig(
            level=cfg.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        log = logging.getLogger("dsv4.kv.sidecar")
        sidecar, control, port = _start(cfg, log)
    except _Refused as e:
        print(f"dsv4 kv-sidecar: error: {e}", file=sys.stderr)
        return 2
    if cfg.ready_file:
        _write_ready_file(cfg.ready_file, cfg, sidecar, control, port)
    hurry = _wait_for_signal(log)
    if not hurry.is_set():
        sidecar.drain(cfg.shutdown_timeout, hurry)
    _stop(sidecar, control, log)


def _config(args: argparse.Namespace) -> SidecarConfig:
    from dsv4_kvtransfer.auth import AuthError, load_token

    if not args.auth_token_file:
        raise _Refused("--auth-token-file is required: sidecars never run unauthenticated")
    try:
        token = load_token(args.auth_token_file)
    except AuthError as e:
        raise _Refused(str(e)) from None
    base = derived_defaults(given(SidecarConfig, args), dict(os.environ))
    try:
        return config_from_args(SidecarConfig, args, base=base, token=token)
    except ValueError as e:
        raise _Refused(str(e)) from None


def _start(cfg: SidecarConfig, log: logging.Logger) -> tuple[Sidecar, ControlServer, int]:
    """The sidecar listening for peers and its control API (and metrics) serving."""
    from dsv4_kvtransfer.control import ControlServer
    from dsv4_kvtransfer.disk_tier import DiskTierError
    from dsv4_kvtransfer.sidecar import Sidecar
    from dsv4_kvtransfer.staging import StagingError
    from dsv4_kvtransfer.transports import TransportUnavailable

    try:
        sidecar = Sidecar(cfg, log)
    except (TransportUnavailable, StagingError, DiskTierError) as e:
        raise _Refused(str(e)) from None
    try:
        port = sidecar.start()
        control = ControlServer(
            sidecar,
            cfg.control_host,
            cfg.control_port,
            cfg.control_socket,
            (cfg.metrics_host, cfg.metrics_port) if cfg.metrics_port is not None else None,
        )
    except OSError as e:
        sidecar.stop()
        raise _Refused(f"cannot listen: {e}") from None
    control.start()
    log.info("control API on http://%s:%d", cfg.control_host, control.port)
    return sidecar, control, port


def _write_ready_file(
    path: str, cfg: SidecarConfig, sidecar: Sidecar, control: ControlServer, port: int
) -> None:
    """Where the sidecar listens, for whoever started it; written whole (renamed into place)."""
    import json

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "pid": os.getpid(),
                "port": port,
                "control_port": control.port,
                "metrics_port": control.metrics_port,
                "shm_name": sidecar.store.region.name,
                "shm_dir": cfg.shm_dir,
            },
            f,
        )
    os.replace(tmp, path)


def _wait_for_signal(log: logging.Logger) -> threading.Event:
    """Block until SIGTERM (drain: the returned event unset) or SIGINT or a second signal (stop
    now: set; it is also set by a signal during the drain)."""
    import signal

    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stop.is_set() or signum == signal.SIGINT:
            hurry.set()
        log.info("signal %d: %s", signum, "stopping" if hurry.is_set() else "draining")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # a timed wait: a signal the kernel hands to another thread only sets a flag, and a main
    # thread blocked in an untimed wait would never run the handler (a SIGTERM was lost so)
    while not stop.wait(0.1):
        pass
    return hurry


def _stop(sidecar: Sidecar, control: ControlServer, log: logging.Logger) -> NoReturn:
    import faulthandler
    import logging
    import sys

    # if the orderly stop below hangs, every thread's stack goes to the log
    faulthandler.dump_traceback_later(STOP_REPORT_S, exit=False)
    control.stop()
    sidecar.stop()
    log.info("stopped")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # everything this process owns is released above; the interpreter's own exit would also
    # finalize the gloo/HCCL process groups' native threads, which can hang (it did in CI:
    # SIGKILLed 10 s after a clean stop)
    os._exit(0)
