"""``dsv4 kv-sidecar``: the KV-transfer sidecar beside an engine.

Only argparse at import time (``dsv4 --help`` builds every subcommand's parser); the sidecar's
modules load inside ``run``.
"""

from __future__ import annotations

import argparse
import os
import re
import socket

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``1073741824``, ``1G``, ``512MiB``, ``64M`` -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1G, 512M, 4096)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transport",
        choices=("tcp", "shm", "hccl", "rdma", "gloo"),
        default="tcp",
        help="how this sidecar pulls KV (it serves every transport it can); hccl needs torch_npu "
        "and an NPU, rdma needs Mooncake; gloo is the collective path on CPU (default tcp)",
    )
    p.add_argument("--port", type=int, default=14579, help="peer port for KV pulls (0: any)")
    p.add_argument("--host", default="0.0.0.0", help="bind address of the peer port")
    p.add_argument(
        "--advertise-host",
        default=None,
        help="address remote sidecars use to reach this one (default $POD_IP, else --host, "
        "else 127.0.0.1)",
    )
    p.add_argument("--engine-url", default=None, help="the engine beside this sidecar")
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=30.0,
        help="how long exported KV waits to be pulled, and pulled KV to be taken by the engine",
    )
    p.add_argument(
        "--auth-token-file",
        default=os.environ.get("DSV4_KV_AUTH_TOKEN_FILE"),
        help="file with the token shared by all sidecars of a deployment (>= 16 bytes); "
        "required (default $DSV4_KV_AUTH_TOKEN_FILE)",
    )
    p.add_argument("--control-host", default="127.0.0.1", help="bind address of the control API")
    p.add_argument(
        "--control-port",
        type=int,
        default=None,
        help="control API, /health and /metrics (default --port + 1; 0: any)",
    )
    p.add_argument("--control-socket", default=None, help="also serve the control API here")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="also serve only /health and /metrics on --metrics-host:PORT, for Prometheus and "
        "probes from outside the pod (default: off; 0: any port)",
    )
    p.add_argument("--metrics-host", default="0.0.0.0", help="bind address of --metrics-port")
    p.add_argument(
        "--staging-bytes", type=parse_size, default=1 << 30, help="staging region size (1G)"
    )
    p.add_argument("--shm-name", default=None, help="staging region name (dsv4-kv-PORT)")
    p.add_argument("--shm-dir", default="/dev/shm", help="where the staging region lives")
    p.add_argument("--streams", type=int, default=4, help="parallel TCP streams per large pull")
    p.add_argument(
        "--min-stream-bytes",
        type=parse_size,
        default=32 << 20,
        help="smallest range worth its own TCP stream (32M)",
    )
    p.add_argument("--max-frame-bytes", type=parse_size, default=64 << 20, help="(64M)")
    p.add_argument("--max-connections", type=int, default=64)
    p.add_argument("--max-concurrent-pulls", type=int, default=8)
    p.add_argument("--pull-timeout", type=float, default=30.0, help="default pull deadline (s)")
    p.add_argument(
        "--send-rate",
        type=parse_size,
        default=0,
        help="cap on bytes/s sent to peers, e.g. 2G (default: none)",
    )
    p.add_argument("--sidecar-id", default=None, help="name in logs and handshakes ($POD_NAME)")
    p.add_argument("--engine-id", default=None, help="default remote_engine_id ($POD_NAME)")
    p.add_argument(
        "--ready-file", default=None, help="write {port, control_port, ...} here once serving"
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _advertise(args: argparse.Namespace) -> str:
    if args.advertise_host:
        return str(args.advertise_host)
    if os.environ.get("POD_IP"):
        return os.environ["POD_IP"]
    if args.host not in ("0.0.0.0", "::", ""):
        return str(args.host)
    return "127.0.0.1"


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import signal
    import sys
    import threading

    from dsv4_kvtransfer.auth import AuthError, load_token
    from dsv4_kvtransfer.config import SidecarConfig
    from dsv4_kvtransfer.staging import StagingError
    from dsv4_kvtransfer.transports import TransportUnavailable

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("dsv4.kv.sidecar")

    def fail(msg: str) -> int:
        print(f"dsv4 kv-sidecar: error: {msg}", file=sys.stderr)
        return 2

    if not args.auth_token_file:
        return fail("--auth-token-file is required: sidecars never run unauthenticated")
    try:
        token = load_token(args.auth_token_file)
    except AuthError as e:
        return fail(str(e))
    if not 0 < args.lease_seconds <= 3600:
        return fail("--lease-seconds must be in (0, 3600]")
    if args.streams < 1 or args.max_concurrent_pulls < 1 or args.max_connections < 1:
        return fail("--streams, --max-concurrent-pulls and --max-connections must be >= 1")
    if args.max_frame_bytes < 4096:
        return fail("--max-frame-bytes must be at least 4096")
    name = os.environ.get("POD_NAME") or socket.gethostname()
    control_port = (
        args.control_port if args.control_port is not None else (args.port + 1 if args.port else 0)
    )
    cfg = SidecarConfig(
        token=token,
        transport=args.transport,
        host=args.host,
        port=args.port,
        advertise_host=_advertise(args),
        control_host=args.control_host,
        control_port=control_port,
        control_socket=args.control_socket,
        engine_url=args.engine_url,
        lease_seconds=args.lease_seconds,
        staging_bytes=args.staging_bytes,
        shm_name=args.shm_name or f"dsv4-kv-{args.port or os.getpid()}",
        shm_dir=args.shm_dir,
        streams=args.streams,
        min_stream_bytes=args.min_stream_bytes,
        max_frame_bytes=args.max_frame_bytes,
        max_connections=args.max_connections,
        max_concurrent_pulls=args.max_concurrent_pulls,
        pull_timeout_s=args.pull_timeout,
        send_rate=float(args.send_rate),
        sidecar_id=args.sidecar_id or name,
        engine_id=args.engine_id or name,
    )

    from dsv4_kvtransfer.control import ControlServer
    from dsv4_kvtransfer.sidecar import Sidecar

    try:
        sidecar = Sidecar(cfg, log)
    except (TransportUnavailable, StagingError) as e:
        return fail(str(e))
    try:
        port = sidecar.start()
        control = ControlServer(
            sidecar,
            cfg.control_host,
            cfg.control_port,
            cfg.control_socket,
            (args.metrics_host, args.metrics_port) if args.metrics_port is not None else None,
        )
    except OSError as e:
        sidecar.stop()
        return fail(f"cannot listen: {e}")
    control.start()
    log.info("control API on http://%s:%d", cfg.control_host, control.port)
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp"
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
        os.replace(tmp, args.ready_file)

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop.wait()
    control.stop()
    sidecar.stop()
    return 0
