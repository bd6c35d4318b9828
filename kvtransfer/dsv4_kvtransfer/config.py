"""The sidecar's one config object: every setting's name, type, default and help, declared once.

``dsv4 kv-sidecar`` builds its flags from these fields (``dsv4_common.config_cli``); the checks
live in ``__post_init__``, so a config built any other way is checked the same.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Literal

from dsv4_common.ports import KV_PORT, sidecar_control_port
from dsv4_common.tracing import check_endpoint

TransportName = Literal["tcp", "shm", "hccl", "rdma", "gloo"]
LogLevel = Literal["debug", "info", "warning", "error"]
MAX_LEASE_S = 3600.0
MIN_FRAME_BYTES = 4096
MIN_DISK_BYTES = 1 << 20
FAST_SUFFIX = ".ctl"  # the fast control socket: <shm-dir>/<shm-name>.ctl


def default_shm_name(port: int) -> str:
    """The staging region's name when none is set: per peer port (or pid), so that sidecars
    on one host never share one."""
    return f"dsv4-kv-{port}"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``1073741824``, ``1G``, ``512MiB``, ``64M`` -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1G, 512M, 4096)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


# the flag of a byte count accepts 64M, 1G, ...
_SIZE_FLAG = {"parse": parse_size}


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    token: bytes
    """Shared secret of all sidecars of a deployment (from --auth-token-file)."""
    transport: TransportName = "tcp"
    """How this sidecar pulls KV (it serves every transport it can); hccl needs torch_npu and an
    NPU, rdma needs Mooncake; gloo is the collective path on CPU."""
    host: str = "0.0.0.0"
    """Bind address of the peer port."""
    port: int = KV_PORT
    """Peer port for KV pulls (0: any free port, reported in the ready file)."""
    advertise_host: str = "127.0.0.1"
    """The address remote sidecars reach this one at (``remote_host`` in the PD params); the
    command line's default is $POD_IP, else --host if it names one address, else 127.0.0.1."""
    control_host: str = "127.0.0.1"
    """Bind address of the local control API (unauthenticated: keep it on loopback)."""
    control_port: int = sidecar_control_port(KV_PORT)
    """Port of the control API, /health and /metrics (0: any free port); the command line's
    default is the peer port + ports.SIDECAR_CONTROL_OFFSET (any free port when that is 0)."""
    control_socket: str | None = None
    """Also serve the control API on this unix socket path."""
    fast_control: bool = True
    """Also serve the control API without HTTP on a unix socket beside the staging region
    (<shm-dir>/<shm-name>.ctl), which the engine's client prefers: a pull's fixed cost was mostly
    HTTP parsing."""
    metrics_port: int | None = None
    """Also serve only /health and /metrics on this port, for Prometheus and probes from
    outside the pod (unset: off; 0: any free port)."""
    metrics_host: str = "0.0.0.0"
    """Bind address of the metrics port."""
    engine_url: str | None = None
    """The engine beside this sidecar (its reachability is reported in /health)."""
    lease_seconds: float = 30.0
    """How long an export waits for its pull, and pulled KV for the engine to take it."""
    staging_bytes: int = field(default=1 << 30, metadata=_SIZE_FLAG)
    """Size of the staging region shared with the engine (e.g. 1G)."""
    kv_host_bytes: int = field(default=0, metadata=_SIZE_FLAG)
    """The host tier: at most this many bytes of the staging region keep prefixes the engine
    offered (finished requests' blocks and boundary state), pullable by id by this engine and
    its peers, evicted least recently used and whenever an export or a pull needs the room
    (0: off)."""
    kv_disk_bytes: int = field(default=0, metadata=_SIZE_FLAG)
    """The disk tier: host-tier entries its LRU evicts spill to files in --kv-disk-dir, at
    most this many bytes of them (least recently spilled dropped first), and come back into
    the host tier when pulled (0: off; else at least 1M, with --kv-host-bytes)."""
    kv_disk_dir: str | None = None
    """The disk tier's directory (created; the tier's files in it are removed at start)."""
    shm_name: str = "dsv4-kv"
    """Name of the staging region; the command line's default is dsv4-kv-PORT."""
    shm_dir: str = "/dev/shm"
    """Where the staging region lives."""
    streams: int = 4
    """Parallel TCP streams per pull (large pulls only)."""
    min_stream_bytes: int = field(default=32 << 20, metadata=_SIZE_FLAG)
    """Smallest range worth its own TCP stream."""
    copy_threads: int = 0
    """Threads copying each same-host (shm) pull (0: one per CPU the sidecar may use, at most
    4)."""
    max_frame_bytes: int = field(default=64 << 20, metadata=_SIZE_FLAG)
    """Largest DATA frame sent or accepted."""
    max_connections: int = 64
    """Peer connections served at once; more are refused."""
    max_concurrent_pulls: int = 8
    """Pulls running at once; more wait their turn."""
    pull_timeout_s: float = 30.0
    """Default deadline of a pull (the engine may ask for another)."""
    connect_timeout_s: float = 5.0
    """Deadline of connecting to (and authenticating with) a peer."""
    io_timeout_s: float = 30.0
    """Longest a peer socket may stay silent mid-request."""
    send_rate: float = field(default=0.0, metadata=_SIZE_FLAG)
    """Cap on bytes/s sent to peers, e.g. 2G, to leave room for other traffic (0: none)."""
    sidecar_id: str = "kv-sidecar"
    """Name in logs and handshakes; the command line's default is $POD_NAME or the hostname."""
    engine_id: str = "engine"
    """Default ``remote_engine_id`` of exports that name none; the command line's default is
    $POD_NAME or the hostname."""
    ready_file: str | None = None
    """Once serving, write {pid, port, control_port, metrics_port, shm_name, shm_dir} here."""
    log_level: LogLevel = "info"
    """Log level of the sidecar process."""
    shutdown_timeout: float = 30.0
    """After SIGTERM: new exports are refused (/ready fails) and the sidecar stays up to this
    many seconds until every export it holds was pulled or its lease ran out."""
    otlp_traces_endpoint: str | None = None
    """OpenTelemetry traces of each request to this OTLP/HTTP endpoint (e.g.
    http://127.0.0.1:4318; /v1/traces is added when no path is given); unset: tracing off."""

    def __post_init__(self) -> None:
        if not 0 < self.lease_seconds <= MAX_LEASE_S:
            raise ValueError(
                f"lease_seconds must be in (0, {MAX_LEASE_S:g}], not {self.lease_seconds}"
            )
        for name in ("streams", "max_concurrent_pulls", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.max_frame_bytes < MIN_FRAME_BYTES:
            raise ValueError(f"max_frame_bytes must be at least {MIN_FRAME_BYTES}")
        for name in ("pull_timeout_s", "connect_timeout_s", "io_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)}")
        if not 0 <= self.shutdown_timeout <= MAX_LEASE_S:
            raise ValueError(
                f"shutdown_timeout must be in [0, {MAX_LEASE_S:g}], not {self.shutdown_timeout}"
            )
        check_endpoint(self.otlp_traces_endpoint)
        if self.send_rate < 0 or self.min_stream_bytes < 1:
            raise ValueError("send_rate must be >= 0 and min_stream_bytes >= 1")
        if not 0 <= self.kv_host_bytes <= self.staging_bytes:
            raise ValueError(
                f"kv_host_bytes must be in [0, staging_bytes={self.staging_bytes}], "
                f"not {self.kv_host_bytes}"
            )
        self._check_disk_tier()
        if self.copy_threads < 0:
            raise ValueError(f"copy_threads must be >= 0, not {self.copy_threads}")
        for name in ("port", "control_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be a port number (0-65535), not {value}")

    def _check_disk_tier(self) -> None:
        n = self.kv_disk_bytes
        if n != 0 and n < MIN_DISK_BYTES:
            raise ValueError(f"--kv-disk-bytes must be 0 (off) or at least 1M, not {n}")
        if n and not self.kv_host_bytes:
            raise ValueError(
                "--kv-disk-bytes needs --kv-host-bytes: the disk tier takes what the host tier evicts"
            )
        if n and not self.kv_disk_dir:
            raise ValueError("--kv-disk-bytes needs --kv-disk-dir (where its files go)")
        if self.kv_disk_dir and not n:
            raise ValueError("--kv-disk-dir without --kv-disk-bytes: the disk tier is off")
