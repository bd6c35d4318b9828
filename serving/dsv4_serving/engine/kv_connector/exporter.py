"""The prefill side's KV exports, off the engine step: reserve, copy, commit on one thread.

``submit`` queues a finished prefill's save and returns at once; the engine keeps stepping
while the thread reserves an extent at the sidecar, copies the request's blocks and slot into
it and commits (three local HTTP calls and a memory copy). ``finished`` hands the results to
the engine's own thread, which only then frees the blocks and sends the response with its
``kv_transfer_params``: until a result is taken, nothing writes the request's blocks or slot
(they are still allocated to it), so the copy reads what the forward wrote.

One thread on purpose: saves complete in submission order, and the copy is bound by memory
bandwidth, which a second thread would share with the forward anyway.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dsv4_kvtransfer.buffers import LayoutError
from dsv4_kvtransfer.client import SidecarClient, SidecarError
from dsv4_kvtransfer.integrity import Fingerprint
from dsv4_kvtransfer.pd_protocol import KVParamsError, RemotePrefillParams
from dsv4_serving.engine.kv_connector.compat import KVCompat
from dsv4_serving.engine.kv_connector.kv_layout import KVLayout
from dsv4_serving.engine.kv_connector.metadata import KVTransferFailure, SaveSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaveResult:
    """One save as the thread left it; the engine's thread accounts for it."""

    request_id: str
    outcome: RemotePrefillParams | KVTransferFailure
    seconds: float  # submit to commit (queueing included)
    nbytes: int  # exported bytes (0 on failure)
    offer: bool = False  # an offer to the host tier (``SaveSpec.prefix_key``), not a PD export


class KVExporter:
    def __init__(
        self,
        client: SidecarClient,
        layout: Callable[[], KVLayout | None],
        compat: KVCompat,
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.client = client
        self._layout = layout
        self.compat = compat
        self._on_done = on_done  # wakes an engine idling until a save completes
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="kv-save")
        self._done: queue.SimpleQueue[SaveResult] = queue.SimpleQueue()
        self._in_flight = 0  # touched by the engine's thread only
        self.fingerprint: Fingerprint | None = None  # set with the layout (the worker's)
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Saves submitted whose result was not taken yet."""
        return self._in_flight

    def submit(self, save: SaveSpec, traceparent: str | None = None) -> None:
        """Start exporting ``save`` (its blocks and slot stay allocated until its result)."""
        self._in_flight += 1
        self._exec.submit(self._run, save, traceparent, time.monotonic())

    def finished(self) -> list[SaveResult]:
        """Saves that completed (or failed) since the last call, in completion order."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self._in_flight -= len(out)
        return out

    def close(self) -> None:
        self._closed = True
        # a save under way finishes (its lease frees it if nobody pulls); queued ones are dropped
        self._exec.shutdown(wait=False, cancel_futures=True)

    # ---- the thread ----------------------------------------------------------------------

    def _run(self, s: SaveSpec, traceparent: str | None, submitted: float) -> None:
        nbytes = 0
        outcome: RemotePrefillParams | KVTransferFailure
        try:
            outcome, nbytes = self._save(s, traceparent)
        except SidecarError as e:
            if s.prefix_key is None or e.code not in ("duplicate", "no_host_tier"):
                log.warning("request %s: KV export failed: %s", s.request_id, e)
            outcome = KVTransferFailure("export_failed", f"KV export failed: {e}")
        except (LayoutError, KVParamsError) as e:
            log.warning("request %s: KV export failed: %s", s.request_id, e)
            outcome = KVTransferFailure("export_failed", f"KV export failed: {e}")
        except Exception as e:  # a bug here must fail the request, not leave it hanging
            log.exception("KV export of %s", s.request_id)
            outcome = KVTransferFailure("export_failed", f"KV export failed: {e}")
        elapsed = time.monotonic() - submitted
        offer = s.prefix_key is not None
        self._done.put(SaveResult(s.request_id, outcome, elapsed, nbytes, offer))
        self._on_done()

    def _save(self, s: SaveSpec, traceparent: str | None) -> tuple[RemotePrefillParams, int]:
        lay = self._layout()
        if lay is None:
            raise LayoutError("no KV cache registered with the connector")
        n = lay.num_blocks(s.num_tokens)
        extra = self.compat.params_extra(s.prompt_token_ids)
        res = self.client.reserve_export(
            s.request_id,
            lay.specs(n),
            block_ids=s.block_ids[:n],
            num_tokens=s.num_tokens,
            state_slot=s.state_slot if lay.state else None,
            cache_groups=lay.cache_groups(n),
            engine_meta={**extra, "first_token": s.first_token},
            params_extra=extra,
            traceparent=traceparent,
            fingerprint=self.fingerprint,
            prefix_key=s.prefix_key,
        )
        try:
            if self._closed:
                raise SidecarError(0, "closed", "the engine is shutting down")
            lay.export(self.client, res.buffers, s.block_ids[:n], s.state_slot)
            # the sidecar's answer is parsed once, here; the typed params travel on
            params = RemotePrefillParams.from_dict(self.client.commit_export(res.transfer_id))
        except BaseException:
            with contextlib.suppress(SidecarError):
                self.client.abort_export(res.transfer_id)
            raise
        return params, res.total_bytes
