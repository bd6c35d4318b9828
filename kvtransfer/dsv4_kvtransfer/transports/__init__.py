"""Transports behind one interface; each is imported only when chosen (torch, torch_npu and
Mooncake stay unloaded unless used)."""

from __future__ import annotations

from typing import Any

from dsv4_kvtransfer.transports.base import (
    FetchJob,
    TransferFailed,
    Transport,
    TransportUnavailable,
)

TRANSPORTS = ("tcp", "shm", "hccl", "rdma", "gloo")


def make_transport(name: str, **options: Any) -> Transport:
    """Build (and check) the transport a sidecar pulls with. ``gloo`` is the collective path on
    CPU (torch.distributed point-to-point, as ``hccl`` does on NPUs), for development and tests."""
    t: Transport
    if name == "tcp":
        from dsv4_kvtransfer.transports.tcp import TcpTransport

        t = TcpTransport(**options)
    elif name == "shm":
        from dsv4_kvtransfer.transports.shm import ShmTransport

        t = ShmTransport(**options)
    elif name in ("hccl", "gloo"):
        from dsv4_kvtransfer.transports.collective import CollectiveTransport

        t = CollectiveTransport(name, **options)
    elif name == "rdma":
        from dsv4_kvtransfer.transports.rdma import RdmaTransport

        t = RdmaTransport(**options)
    else:
        raise TransportUnavailable(f"unknown transport {name!r}; choose one of {TRANSPORTS}")
    t.check_available()
    return t


__all__ = [
    "TRANSPORTS",
    "FetchJob",
    "TransferFailed",
    "Transport",
    "TransportUnavailable",
    "make_transport",
]
