"""Collective point-to-point: torch.distributed send/recv between the two sidecars.

``hccl`` on Ascend (torch_npu's ProcessGroupHCCL, bytes staged through an NPU buffer so they
cross HCCS/RoCE), ``gloo`` on CPU (the same path with CPU tensors straight over the staging
memory; it is how this transport is tested without NPUs). No global process group: each
connection builds a two-rank group of its own (the remote sidecar rank 0, us rank 1) through a
``TCPStore`` we host and announce over the authenticated control connection, and keeps it for
the connection's life, since HCCL's group setup is far too slow to pay per request.

torch and torch_npu are imported only when this transport is used.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from dsv4_kvtransfer.frames import FrameType, read_frame
from dsv4_kvtransfer.peer import PeerConnection
from dsv4_kvtransfer.transports.base import (
    FetchJob,
    TransferFailed,
    Transport,
    TransportUnavailable,
)

BACKENDS = ("hccl", "gloo")
CHUNK = 64 << 20


def load_backend(backend: str) -> Any:
    """Import torch (and torch_npu for hccl) and check a device is there; -> torch."""
    if backend not in BACKENDS:
        raise TransportUnavailable(f"unknown collective backend {backend!r}")
    try:
        import torch
        import torch.distributed
    except ImportError as e:
        raise TransportUnavailable(f"the {backend} transport needs torch: {e}") from None
    if backend == "hccl":
        try:
            import torch_npu  # noqa: F401
        except ImportError as e:
            raise TransportUnavailable(
                "the hccl transport needs torch_npu (Ascend CANN toolkit) and an NPU visible to "
                f"the sidecar: cannot import torch_npu ({e}); use --transport tcp off Ascend"
            ) from None
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise TransportUnavailable(
                "the hccl transport needs an NPU visible to the sidecar: torch_npu imports but "
                "sees no device (check ASCEND_RT_VISIBLE_DEVICES and the device plugin)"
            )
    return torch


def device_for(backend: str) -> str:
    if backend == "hccl":
        return f"npu:{int(os.environ.get('DSV4_KV_DEVICE_ID', os.environ.get('LOCAL_RANK', '0')))}"
    return "cpu"


def make_group(backend: str, store: Any, rank: int, timeout_s: float) -> Any:
    """A two-rank process group over ``store`` without touching the global default group."""
    torch = load_backend(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, 2, timeout)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    options = ProcessGroupHCCL.Options()
    options._timeout = timeout
    return ProcessGroupHCCL(store, rank, 2, options)


@dataclass(slots=True)
class Channel:
    """One side's half of a two-rank group. With ``staged`` (any device but the CPU) bytes go
    through a bounce buffer on ``device``, ``chunk`` bytes at a time: HCCL moves device memory
    only, and a fixed bounce buffer bounds the device memory a transfer takes."""

    backend: str
    group: Any
    store: Any
    device: str
    staged: bool | None = None
    chunk: int = CHUNK
    bounce: Any = None

    def __post_init__(self) -> None:
        if self.staged is None:
            self.staged = self.device != "cpu"

    def _tensor(self, view: memoryview) -> Any:
        import torch

        return torch.frombuffer(view, dtype=torch.uint8)

    def send(self, view: memoryview, peer: int) -> None:
        for pos in range(0, len(view), self.chunk):
            host = self._tensor(view[pos : pos + self.chunk])
            if not self.staged:
                self.group.send([host], peer, 0).wait()
                continue
            dev = self._bounce(host.numel())
            dev.copy_(host)
            self.group.send([dev], peer, 0).wait()

    def recv(self, view: memoryview, peer: int, progress: Any) -> None:
        for pos in range(0, len(view), self.chunk):
            host = self._tensor(view[pos : pos + self.chunk])
            if not self.staged:
                self.group.recv([host], peer, 0).wait()
            else:
                dev = self._bounce(host.numel())
                self.group.recv([dev], peer, 0).wait()
                host.copy_(dev)
            progress(host.numel())

    def _bounce(self, n: int) -> Any:
        import torch

        if self.bounce is None:
            self.bounce = torch.empty(self.chunk, dtype=torch.uint8, device=self.device)
        return self.bounce[:n]

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):
                shutdown()
        self.group = None
        self.store = None
        self.bounce = None


def open_server_channel(meta: dict[str, Any], timeout_s: float) -> Channel:
    """Rank 0 (the exporting side) joins the group the puller announced in ``PG_OPEN``."""
    backend = meta.get("backend")
    host, port, prefix = meta.get("store_host"), meta.get("store_port"), meta.get("prefix")
    if not (
        isinstance(backend, str)
        and isinstance(host, str)
        and isinstance(port, int)
        and isinstance(prefix, str)
        and 0 < port < 65536
    ):
        raise TransferFailed("protocol", "bad PG_OPEN")
    torch = load_backend(backend)
    store = torch.distributed.TCPStore(
        host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    pstore = torch.distributed.PrefixStore(prefix, store)
    return Channel(backend, make_group(backend, pstore, 0, timeout_s), store, device_for(backend))


class CollectiveTransport(Transport):
    def __init__(self, backend: str, timeout_s: float = 60.0) -> None:
        self.name = backend
        self.backend = backend
        self.timeout_s = timeout_s

    def check_available(self) -> None:
        load_backend(self.backend)

    def _channel(self, conn: PeerConnection) -> Channel:
        ch = conn.extras.get("channel")
        if isinstance(ch, Channel):
            return ch
        torch = load_backend(self.backend)
        host = conn.sock.getsockname()[0]
        store = torch.distributed.TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        prefix = f"dsv4-kv/{secrets.token_hex(8)}/"
        conn.request(
            FrameType.PG_OPEN,
            {
                "backend": self.backend,
                "store_host": host,
                "store_port": store.port,
                "prefix": prefix,
            },
            FrameType.PG_ACCEPT,
        )
        pstore = torch.distributed.PrefixStore(prefix, store)
        group = make_group(self.backend, pstore, 1, self.timeout_s)
        ch = Channel(self.backend, group, store, device_for(self.backend))
        conn.extras["channel"] = ch
        conn.on_close.append(ch.close)
        return ch

    def fetch(self, job: FetchJob) -> None:
        conn = job.control
        ch = self._channel(conn)
        length = len(job.dest)
        # the remote checks the request before it starts sending: an ERROR here, not a hang
        conn.request(
            FrameType.PG_SEND,
            {"transfer_id": job.transfer_id, "offset": 0, "length": length},
            FrameType.PG_ACCEPT,
        )
        if time.monotonic() > job.deadline:
            raise TimeoutError("the pull ran past its deadline")
        ch.recv(job.dest, 0, job.progress)
        done = read_frame(conn.sock, conn.limits)
        if done.type != FrameType.PG_SENT:
            raise TransferFailed("protocol", f"expected PG_SENT, got {done.type.name}")


__all__ = ["Channel", "CollectiveTransport", "load_backend", "open_server_channel"]
