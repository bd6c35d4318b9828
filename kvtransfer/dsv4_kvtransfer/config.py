"""The sidecar's one config object, built from the command line at the edge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TransportName = Literal["tcp", "shm", "hccl", "rdma", "gloo"]


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    token: bytes
    """Shared secret of all sidecars of a deployment (from --auth-token-file)."""
    transport: TransportName = "tcp"
    """How this sidecar pulls; it serves every transport it can, whatever this says."""
    host: str = "0.0.0.0"
    """Bind address of the peer port."""
    port: int = 14579
    """Peer port (0: any free port, reported in the ready file)."""
    advertise_host: str = "127.0.0.1"
    """The address remote sidecars reach us at (``remote_host`` in the PD params)."""
    control_host: str = "127.0.0.1"
    """Bind address of the local control API, /health and /metrics."""
    control_port: int = 14580
    """Port of the control API (0: any free port)."""
    control_socket: str | None = None
    """Also serve the control API on this unix socket path."""
    engine_url: str | None = None
    """The engine beside us (reported in /health)."""
    lease_seconds: float = 30.0
    """How long an export waits for its pull, and a pulled extent for the engine to release it."""
    staging_bytes: int = 1 << 30
    """Size of the staging region shared with the engine."""
    shm_name: str = "dsv4-kv"
    shm_dir: str = "/dev/shm"
    streams: int = 4
    """Parallel TCP streams per pull (large pulls only)."""
    min_stream_bytes: int = 32 << 20
    max_frame_bytes: int = 64 << 20
    """Largest DATA frame sent or accepted."""
    max_connections: int = 64
    max_concurrent_pulls: int = 8
    pull_timeout_s: float = 30.0
    """Default deadline of a pull (the engine may ask for another)."""
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 30.0
    send_rate: float = 0.0
    """Cap on bytes/s this sidecar sends to peers (0: none), e.g. to leave room for other traffic."""
    sidecar_id: str = "kv-sidecar"
    engine_id: str = "engine"
    """Default ``remote_engine_id`` for exports that do not name one."""
