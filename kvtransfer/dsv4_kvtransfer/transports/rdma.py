"""RDMA reads through Mooncake's transfer engine, where ``mooncake.engine`` imports.

Both sidecars register their staging region with a Mooncake ``TransferEngine`` (peer-to-peer
handshake, no metadata server). The exporting side pins the export and answers ``RDMA_MAP``
with its engine session and the extent's address; the puller issues one-sided reads into its own
registered extent. Written against Mooncake's documented Python API (``initialize``,
``get_rpc_port``, ``register_memory``, ``transfer_sync_read``); it cannot run on a host without
libibverbs/RDMA NICs, and fails at start-up with a message that says so.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dsv4_kvtransfer.frames import FrameType
from dsv4_kvtransfer.staging import StagingRegion
from dsv4_kvtransfer.transports.base import (
    FetchJob,
    TransferFailed,
    Transport,
    TransportUnavailable,
)

CHUNK = 256 << 20


def load_mooncake() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except Exception as e:  # ImportError, or OSError from a missing libibverbs/libcudart
        raise TransportUnavailable(
            "the rdma transport needs Mooncake's transfer engine (pip install "
            "mooncake-transfer-engine) with libibverbs and an RDMA NIC: cannot import "
            f"mooncake.engine ({type(e).__name__}: {e}); use --transport tcp"
        ) from None
    return TransferEngine


class MooncakeEndpoint:
    """This sidecar's Mooncake engine with its staging region registered."""

    def __init__(self, hostname: str, device_name: str = "") -> None:
        self._engine = load_mooncake()()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", "rdma", device_name)
        if rc != 0:
            raise TransportUnavailable(f"Mooncake TransferEngine.initialize failed ({rc})")
        self.session = f"{hostname}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._registered: set[int] = set()

    def register(self, region: StagingRegion) -> int:
        base = region.address()
        with self._lock:
            if base not in self._registered:
                rc = self._engine.register_memory(base, region.size)
                if rc != 0:
                    raise TransportUnavailable(f"Mooncake register_memory failed ({rc})")
                self._registered.add(base)
        return base

    def read(self, session: str, local: int, remote: int, length: int) -> None:
        rc = self._engine.transfer_sync_read(session, local, remote, length)
        if rc != 0:
            raise TransferFailed("rdma", f"Mooncake transfer_sync_read failed ({rc})")


class RdmaTransport(Transport):
    name = "rdma"

    def __init__(self, hostname: str = "127.0.0.1", device_name: str = "") -> None:
        self.hostname = hostname
        self.device_name = device_name
        self.endpoint: MooncakeEndpoint | None = None
        self.region: StagingRegion | None = None

    def check_available(self) -> None:
        load_mooncake()

    def bind(self, region: StagingRegion) -> MooncakeEndpoint:
        """Create the engine and register ``region`` (the sidecar calls this at start-up)."""
        if self.endpoint is None:
            self.endpoint = MooncakeEndpoint(self.hostname, self.device_name)
        self.endpoint.register(region)
        self.region = region
        return self.endpoint

    def fetch(self, job: FetchJob) -> None:
        if self.endpoint is None or self.region is None:
            raise TransferFailed("rdma", "the rdma transport was not bound to a staging region")
        info = job.control.request(
            FrameType.RDMA_MAP, {"transfer_id": job.transfer_id}, FrameType.RDMA_INFO
        )
        session, addr, length = info.get("session"), info.get("addr"), info.get("length")
        if not (
            isinstance(session, str)
            and isinstance(addr, int)
            and isinstance(length, int)
            and length == len(job.dest)
        ):
            raise TransferFailed("protocol", f"bad RDMA_INFO from the remote sidecar: {info}")
        import ctypes

        local = ctypes.addressof(ctypes.c_char.from_buffer(job.dest))
        for pos in range(0, length, CHUNK):
            if time.monotonic() > job.deadline:
                raise TimeoutError("the pull ran past its deadline")
            n = min(CHUNK, length - pos)
            self.endpoint.read(session, local + pos, addr + pos, n)
            job.progress(n)
