"""The sidecar's spans of traced requests (``--otlp-traces-endpoint``), children of the engine
span whose ``traceparent`` came with the control call:

    dsv4.kv.lease     prefill side: an export from its reservation until it is freed (pulled,
                      aborted or expired), with its bytes
    dsv4.kv.transfer  decode side: one pull, manifest to last byte (bytes, transport, bandwidth)

Both are recorded with their measured times once they end, so nothing is held open across
threads. A sidecar with tracing off has no ``SidecarSpans`` (its parts hold ``None``).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from dsv4_common import tracing

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer

MAX_OPEN_LEASES = 100_000  # a bound, should frees ever be missed


class SidecarSpans:
    def __init__(self, tracer: Tracer, sidecar_id: str, transport: str) -> None:
        self.tracer = tracer
        self.attrs = {"dsv4.sidecar.id": sidecar_id}
        self.transport = transport
        self._leases: dict[str, tuple[Context, int, int, str]] = {}
        self._lock = threading.Lock()

    def export_reserved(
        self, transfer_id: str, traceparent: str | None, nbytes: int, request_id: str
    ) -> None:
        parent = tracing.from_traceparent(traceparent)
        if parent is None:
            return
        with self._lock:
            if len(self._leases) < MAX_OPEN_LEASES:
                self._leases[transfer_id] = (parent, time.time_ns(), nbytes, request_id)

    def export_freed(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            lease = self._leases.pop(transfer_id, None)
        if lease is None:
            return
        parent, start_ns, nbytes, request_id = lease
        tracing.record(
            self.tracer,
            "dsv4.kv.lease",
            parent,
            start_ns,
            time.time_ns(),
            {
                **self.attrs,
                "dsv4.kv.transfer_id": transfer_id,
                "dsv4.kv.bytes": nbytes,
                "dsv4.kv.freed": reason,
                "dsv4.engine.request_id": request_id,
            },
            error=None if reason != "expired" else "the lease ran out before a pull",
        )

    def transfer(
        self,
        traceparent: str | None,
        start_ns: int,
        nbytes: int,
        data_s: float | None,
        remote: str,
        error: str | None = None,
        reason: str | None = None,
    ) -> None:
        parent = tracing.from_traceparent(traceparent)
        if parent is None:
            return
        attrs: dict[str, Any] = {
            **self.attrs,
            "dsv4.kv.bytes": nbytes,
            "dsv4.kv.transport": self.transport,
            "server.address": remote,
        }
        if data_s:
            attrs["dsv4.kv.bandwidth_bytes_per_s"] = round(nbytes / data_s)
            attrs["dsv4.kv.data_seconds"] = round(data_s, 6)
        if reason is not None:
            attrs["dsv4.kv.failure"] = reason
        tracing.record(
            self.tracer,
            "dsv4.kv.transfer",
            parent,
            start_ns,
            time.time_ns(),
            attrs,
            span_kind="client",
            error=error,
        )
