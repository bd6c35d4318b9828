"""The worker side of the sidecar connector.

Loads run on one thread per pull (long-polls of the sidecar, never the engine loop; a same-host
shm pull is copied into the staging region on that thread by the client itself, into an extent
its sidecar granted it: ``dsv4_kvtransfer.local_pull``); the copy into the cache happens in
``get_finished``, which the engine core calls between forwards.
A pull's staging extent is released as soon as it was copied, failed or its request went
away. Saves run on the exporter's thread (``exporter.py``): the step that finished a prefill
only submits it; a later step takes the result (``get_finished_saves``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsv4_kvtransfer.buffers import Layout, LayoutError
from dsv4_kvtransfer.client import PulledKV, PullFailed, SidecarClient, SidecarError
from dsv4_kvtransfer.integrity import Fingerprint
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_serving.engine.kv_connector.base import KVConnectorWorker
from dsv4_serving.engine.kv_connector.compat import KVCompat, KVIncompatible, KVPromptMismatch
from dsv4_serving.engine.kv_connector.exporter import KVExporter
from dsv4_serving.engine.kv_connector.host_evictions import HostEvictionWatcher
from dsv4_serving.engine.kv_connector.kv_layout import KVLayout
from dsv4_serving.engine.kv_connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorStats,
    KVTransferFailure,
    LoadSpec,
    SaveSpec,
)

log = logging.getLogger(__name__)
POLL_S = 0.5  # one long-poll of the sidecar; also how fast a cancelled pull lets go


@dataclass(slots=True)
class _Pull:
    spec: LoadSpec
    started: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    traceparent: str | None = None


class SidecarConnectorWorker(KVConnectorWorker):
    def __init__(
        self,
        url: str,
        compat: KVCompat,
        stats: KVConnectorStats,
        pull_timeout_s: float = 30.0,
    ) -> None:
        self.client = SidecarClient(url)
        self.compat = compat
        self.stats = stats  # export counters (the scheduler side counts the pulls)
        self.pull_timeout_s = pull_timeout_s
        self.layout: KVLayout | None = None
        self.fingerprint: Fingerprint | None = None
        self._pulls: dict[str, _Pull] = {}
        self._done: queue.SimpleQueue[tuple[_Pull, str | None, PulledKV | KVTransferFailure]] = (
            queue.SimpleQueue()
        )
        self._event = threading.Event()
        self._closed = False
        # tracing on: a request's current KV span, whose context goes with the sidecar call
        self.traceparent_of: Callable[[str], str | None] | None = None
        self.exporter = KVExporter(self.client, lambda: self.layout, compat, self._event.set)
        self._evictions: HostEvictionWatcher | None = None

    def register_kv_caches(self, cache: Any) -> None:
        self.layout = KVLayout(cache)
        # exports carry it, pulls refuse KV of another (``fingerprint_mismatch``), and bytes
        # that are not what was exported (``checksum_mismatch``): the sidecar and its client
        # check both before the KV is handed to us; the failure policy recomputes
        self.fingerprint = self.compat.fingerprint(self.layout.rows(), self.layout.parallel)
        self.exporter.fingerprint = self.fingerprint

    def host_tier_peer(self) -> str | None:
        """``HOST:PORT`` other sidecars pull our sidecar's host tier from (its advertised
        peer address); None when it keeps no offered prefixes."""
        try:
            info = self.client.info()
        except (SidecarError, OSError) as e:
            log.warning("KV sidecar unreachable, no prefix offers: %s", e)
            return None
        if int(info.get("host_bytes") or 0) <= 0:
            return None
        return f"{info.get('advertise_host')}:{info.get('port')}"

    def watch_host_evictions(self) -> None:
        """Follow our host tier's evictions from now on (``take_host_evictions``)."""
        if self._evictions is None:
            self._evictions = HostEvictionWatcher(self.client)

    def take_host_evictions(self) -> list[tuple[str, str | None]]:
        """Host-tier entries evicted (medium None) or moved since the last call."""
        return self._evictions.take() if self._evictions is not None else []

    def _prefix_params(self, spec: LoadSpec) -> RemotePrefillParams:
        """The pull of a host tier's entry as an ordinary pull: its id comes from its key, its
        size and groups from our own layout (an entry of another layout fails the pull's size
        check, or the import's)."""
        assert self.layout is not None and spec.prefix is not None
        n = self.layout.num_blocks(spec.num_tokens)
        pull = spec.prefix
        return RemotePrefillParams(
            remote_engine_id="host-tier",
            remote_request_id=pull.transfer_id,
            remote_block_ids=(),
            remote_host=pull.remote_host,
            remote_port=pull.remote_port,
            remote_transfer_id=pull.transfer_id,
            remote_lease_expires_at=time.time() + self.pull_timeout_s,
            remote_num_tokens=spec.num_tokens,
            remote_total_bytes=Layout.plan(self.layout.specs(n)).total_bytes,
            remote_cache_groups=self.layout.cache_groups(n),
        )

    # ---- decode: pulls -------------------------------------------------------------------

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for rid in meta.cancelled:
            p = self._pulls.get(rid)
            if p is not None:
                p.cancelled.set()
        for spec in meta.loads:
            p = _Pull(spec)
            if self.traceparent_of is not None:
                p.traceparent = self.traceparent_of(spec.request_id)
            self._pulls[spec.request_id] = p
            threading.Thread(
                target=self._pull, args=(p,), name=f"kv-pull-{spec.request_id}", daemon=True
            ).start()

    def _pull(self, p: _Pull) -> None:
        c = self.client
        pull_id: str | None = None
        result: PulledKV | KVTransferFailure
        # the sidecar gives up at pull_timeout_s; this bounds us if it stops answering
        deadline = p.started + self.pull_timeout_s + 5.0
        try:
            params = p.spec.params or self._prefix_params(p.spec)
            st = c.start_pull(
                params,
                timeout_s=self.pull_timeout_s,
                wait_s=POLL_S,
                traceparent=p.traceparent,
                fingerprint=self.fingerprint,
            )
            pull_id = st.pull_id
            while True:
                if st.kv is not None:
                    result = st.kv
                    break
                if p.cancelled.is_set() or self._closed:
                    result = KVTransferFailure("cancelled", "the request went away")
                    break
                if time.monotonic() > deadline:
                    result = KVTransferFailure(
                        "timeout", f"KV pull not done after {self.pull_timeout_s:g}s"
                    )
                    break
                st = c.poll_pull(pull_id, wait_s=POLL_S)
        except PullFailed as e:
            result = KVTransferFailure(e.reason or "unknown", f"KV pull failed ({e.reason}): {e}")
            pull_id = None  # the sidecar freed it already
        except SidecarError as e:
            reason = "bad_params" if e.status == 400 else "sidecar"
            result = KVTransferFailure(reason, f"local KV sidecar: {e}")
        except Exception as e:  # a bug here must fail the request, not hang it
            log.exception("KV pull of %s", p.spec.request_id)
            result = KVTransferFailure("internal", f"{type(e).__name__}: {e}")
        if pull_id is not None and (isinstance(result, KVTransferFailure) or p.cancelled.is_set()):
            self._release(pull_id)
            pull_id = None
        self._done.put((p, pull_id, result))
        self._event.set()

    def _release(self, pull_id: str) -> None:
        with contextlib.suppress(SidecarError):
            self.client.release_pull(pull_id)

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        while True:
            try:
                p, pull_id, result = self._done.get_nowait()
            except queue.Empty:
                break
            rid = p.spec.request_id
            if self._pulls.get(rid) is p:
                del self._pulls[rid]
            if p.cancelled.is_set():
                if pull_id is not None:
                    self._release(pull_id)
                continue
            if isinstance(result, KVTransferFailure):
                log.warning("request %s: %s", rid, result.message)
                out.failed[rid] = result
                continue
            assert pull_id is not None
            try:
                out.bytes_pulled += self._import(p.spec, result)
                out.loaded.append(rid)
                n = self.layout.num_blocks(p.spec.num_tokens) if self.layout else 0
                loaded = p.spec.block_ids if p.spec.prefix else p.spec.block_ids[:n]
                out.loaded_kv.append((loaded, p.spec.state_slot))
                out.pull_seconds.append(time.monotonic() - p.started)
            except KVIncompatible as e:
                log.error("request %s: %s", rid, e)
                out.failed[rid] = KVTransferFailure("incompatible", str(e))
            except (SidecarError, LayoutError, KeyError) as e:
                out.failed[rid] = KVTransferFailure("import", f"KV import failed: {e}")
            finally:
                self._release(pull_id)
        return out

    def _import(self, spec: LoadSpec, kv: PulledKV) -> int:
        assert self.layout is not None
        remote_tokens = kv.remote_meta.get("num_tokens")
        # a prefill exports every prompt token; a drained sequence every token but its last
        # (never forwarded there): either way the last one is computed here
        if remote_tokens not in (spec.num_tokens, spec.num_tokens - 1):
            raise KVIncompatible(
                f"the prefill engine exported {remote_tokens} tokens of KV, this request's "
                f"prompt has {spec.num_tokens}"
            )
        n = self.layout.num_blocks(remote_tokens)
        self.layout.check(kv.buffers, n)
        if spec.prefix is not None:
            self._verify_prefix(spec, kv)
        if time.time() > kv.lease_expires_at - 0.5:  # the sidecar may reuse the extent
            raise SidecarError(0, "expired", "the pulled KV's lease ran out before the import")
        if spec.prefix is not None:
            return self.layout.load(
                self.client, kv.buffers, spec.block_ids, spec.state_slot, spec.first_block
            )
        return self.layout.load(self.client, kv.buffers, spec.block_ids[:n], spec.state_slot)

    def _verify_prefix(self, spec: LoadSpec, kv: PulledKV) -> None:
        """The one check of a host tier's entry before it is used: the offering engine's layout
        and the hash of the tokens it computed (``KVIncompatible`` / ``KVPromptMismatch``
        either way: the prefix is computed here instead). Transfer checksums go here too."""
        meta = kv.remote_meta.get("engine_meta")
        if not isinstance(meta, dict):
            raise KVIncompatible("the host tier's entry carries no engine metadata")
        try:
            self.compat.check(meta, spec.token_ids)
        except KVPromptMismatch as e:
            raise KVIncompatible(f"the host tier's entry is of other tokens: {e}") from None

    def wake(self) -> None:
        """Ends a ``wait_for_event`` (the core waits for its step and for KV alike)."""
        self._event.set()

    def wait_for_event(self, timeout_s: float) -> None:
        """Until a pull or a save ends (both set the event) or ``timeout_s`` passes."""
        if self._event.wait(timeout_s):
            self._event.clear()

    # ---- prefill: exports (on the exporter's thread) ----------------------------------------

    def start_save_kv(self, saves: list[SaveSpec], traceparents: dict[str, str | None]) -> None:
        for s in saves:
            self.exporter.submit(s, traceparents.get(s.request_id))

    def get_finished_saves(self) -> dict[str, RemotePrefillParams | KVTransferFailure]:
        out: dict[str, RemotePrefillParams | KVTransferFailure] = {}
        for r in self.exporter.finished():
            out[r.request_id] = r.outcome
            # the stats are the engine thread's: counted here, not on the exporter's thread
            if r.offer:  # the host tier's: not a PD export (a duplicate offer is no failure)
                if not isinstance(r.outcome, KVTransferFailure):
                    self.stats.bytes_exported += r.nbytes
            elif isinstance(r.outcome, KVTransferFailure):
                self.stats.export_failures += 1
            else:
                self.stats.exports_ok += 1
                self.stats.export_seconds.append(r.seconds)
                self.stats.bytes_exported += r.nbytes
        return out

    def close(self) -> None:
        self._closed = True
        if self._evictions is not None:
            self._evictions.close()
        for p in self._pulls.values():
            p.cancelled.set()
        self.exporter.close()
        self.client.close()
