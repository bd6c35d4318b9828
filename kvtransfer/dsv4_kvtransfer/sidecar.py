"""The KV sidecar: composes the staging store, the export API, the puller, the peer port and
the sweeper, and starts and stops them.

One per engine pod. The engine talks to it over the local control API (``control.py``); remote
sidecars over the peer port (``peer_server.py``). All bookkeeping goes through the
``StagingStore`` (the ledger under one lock); bytes move outside the lock, straight between
sockets (or mappings) and the region.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.request
from typing import Any

from dsv4_common import tracing
from dsv4_kvtransfer.allocator import ExtentAllocator
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.disk_tier import DiskTier
from dsv4_kvtransfer.exports import Exports
from dsv4_kvtransfer.frames import FrameLimits
from dsv4_kvtransfer.kv_spans import SidecarSpans
from dsv4_kvtransfer.ledger import Freed, Ledger
from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_kvtransfer.peer_server import PeerServer, PeerServerConfig
from dsv4_kvtransfer.puller import Puller
from dsv4_kvtransfer.staging import HEADER_BYTES, StagingRegion
from dsv4_kvtransfer.store import StagingStore
from dsv4_kvtransfer.transports import Transport, make_transport

ENGINE_PROBE_S = 10.0


class Sidecar:
    def __init__(self, cfg: SidecarConfig, log: logging.Logger | None = None) -> None:
        self.cfg = cfg
        self.log = log or logging.getLogger("dsv4.kv.sidecar")
        self.metrics = SidecarMetrics()
        # fail fast on a transport that cannot run here, before anything is created
        self.transport: Transport = make_transport(cfg.transport, **self._transport_options())
        region = StagingRegion.create(cfg.shm_name, cfg.staging_bytes, cfg.shm_dir)
        rdma_session: str | None = None
        if cfg.transport == "rdma":
            from dsv4_kvtransfer.transports.rdma import RdmaTransport

            assert isinstance(self.transport, RdmaTransport)
            rdma_session = self.transport.bind(region).session
        ledger = Ledger(ExtentAllocator(HEADER_BYTES, cfg.staging_bytes - HEADER_BYTES))
        ledger.host_bytes = cfg.kv_host_bytes
        # exports published in the region (a trailer each): a same-host shm pull of them
        # needs no round trip to this sidecar before its copy
        self.store = StagingStore(region, ledger, self.metrics, rdma_session, publish=True)
        self.disk: DiskTier | None = None
        if cfg.kv_disk_bytes:
            assert cfg.kv_disk_dir is not None  # (SidecarConfig checks it)
            self.disk = DiskTier(cfg.kv_disk_dir, cfg.kv_disk_bytes, self.metrics)
            try:
                self.disk.open()  # DiskTierError: the caller refuses to start
            except BaseException:
                self.transport.close()
                region.close()
                raise
            self.store.attach_disk(self.disk)
        self.port = cfg.port
        self.exports = Exports(self.store, cfg, lambda: self.port)
        self.puller = Puller(self.store, self.transport, cfg, self.metrics, self.log)
        self.peer = PeerServer(
            PeerServerConfig(
                host=cfg.host,
                port=cfg.port,
                server_id=cfg.sidecar_id,
                token=cfg.token,
                limits=FrameLimits(max_payload=cfg.max_frame_bytes),
                max_connections=cfg.max_connections,
                io_timeout_s=cfg.io_timeout_s,
                send_rate=cfg.send_rate,
            ),
            self.store,
            self.metrics,
            self.log,
        )
        tracer = tracing.setup(
            cfg.otlp_traces_endpoint, "dsv4-kv-sidecar", {"service.instance.id": cfg.sidecar_id}
        )
        if tracer is not None:  # off: the parts keep None and make no spans
            spans = SidecarSpans(tracer, cfg.sidecar_id, cfg.transport)
            self.store.spans = self.exports.spans = self.puller.spans = spans
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.engine_status = "unknown"
        # the fast control socket's name in shm_dir, once the control server listens on it
        self.fast_socket: str | None = None

    def _transport_options(self) -> dict[str, Any]:
        c = self.cfg
        if c.transport == "tcp":
            return {"streams": c.streams, "min_stream_bytes": c.min_stream_bytes}
        if c.transport == "shm":
            return {"shm_dir": c.shm_dir, "copy_threads": c.copy_threads}
        if c.transport in ("hccl", "gloo"):
            return {"timeout_s": c.io_timeout_s}
        return {"hostname": c.advertise_host}

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> int:
        self.port = self.peer.start()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kv-sweeper", daemon=True)
        self._sweeper.start()
        self.log.info(
            "kv sidecar %s: peer port %s:%d (advertised %s), transport %s, staging %s/%s "
            "(%d bytes), lease %.1fs",
            self.cfg.sidecar_id,
            self.cfg.host,
            self.port,
            self.cfg.advertise_host,
            self.cfg.transport,
            self.cfg.shm_dir,
            self.cfg.shm_name,
            self.store.ledger.alloc.size,
            self.cfg.lease_seconds,
        )
        return self.port

    def drain(self, timeout_s: float, give_up: threading.Event | None = None) -> int:
        """Refuse new exports, then wait (up to ``timeout_s``, or until ``give_up`` is set) until
        every export held was pulled or its lease ran out; -> how many are left."""
        self.exports.draining = True
        deadline = time.monotonic() + timeout_s
        give_up = give_up or threading.Event()
        while (left := self.store.usage().exports) and time.monotonic() < deadline:
            if give_up.wait(0.05):
                break
        if left:
            self.log.warning("shutdown: %d export(s) not pulled after %.1fs", left, timeout_s)
        return left

    @property
    def ready(self) -> bool:
        return not self.exports.draining

    def stop(self) -> None:
        self._stop.set()
        self.peer.stop()
        self.puller.stop()
        self.transport.close()
        if self.disk is not None:
            self.disk.close()
        self.store.region.close()

    def _sweep_loop(self) -> None:
        every = min(0.25, self.cfg.lease_seconds / 4)
        last_probe = 0.0
        while not self._stop.wait(every):
            self.sweep()
            if self.cfg.engine_url and time.monotonic() - last_probe > ENGINE_PROBE_S:
                last_probe = time.monotonic()
                self.engine_status = _probe(self.cfg.engine_url)

    def sweep(self) -> list[Freed]:
        freed = self.store.sweep()
        for f in freed:
            self.log.info("lease expired: %s %s (%d bytes freed)", f.kind, f.key, f.nbytes)
        if freed:
            self.puller.on_expired([f.key for f in freed if f.kind == "import"])
        self.puller.prune()
        return freed

    # ---- status ------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        u = self.store.usage()
        region = self.store.region
        return {
            "sidecar_id": self.cfg.sidecar_id,
            "pid": os.getpid(),
            "transport": self.cfg.transport,
            "advertise_host": self.cfg.advertise_host,
            "port": self.port,
            "shm_name": region.name,
            "shm_tag": region.tag_hex,
            "shm_dir": self.cfg.shm_dir,
            "header_bytes": HEADER_BYTES,
            "staging_bytes": u.staging_bytes,
            "free_bytes": u.free_bytes,
            "granted_bytes": u.granted_bytes,
            "used_bytes": u.used_bytes,
            "largest_free": u.largest_free,
            "exports": u.exports,
            "imports": u.imports,
            "host_bytes": self.cfg.kv_host_bytes,
            "host_tier_bytes": u.cached_bytes,
            "host_tier_entries": u.cached_entries,
            **self._disk_info(),
            "pulls": self.puller.count(),
            "lease_seconds": self.cfg.lease_seconds,
            "max_frame_bytes": self.cfg.max_frame_bytes,
            "fast_socket": self.fast_socket,
        }

    def _disk_info(self) -> dict[str, Any]:
        used, entries = self.disk.usage() if self.disk is not None else (0, 0)
        return {
            "disk_bytes": self.cfg.kv_disk_bytes,
            "disk_tier_bytes": used,
            "disk_tier_entries": entries,
        }

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "transport": self.cfg.transport, "engine": self.engine_status}


def _probe(url: str) -> str:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=1) as r:
            return "ok" if r.status == 200 else f"http {r.status}"
    except Exception:
        return "unreachable"
