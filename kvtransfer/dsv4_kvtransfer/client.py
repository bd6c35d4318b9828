"""What the engine's connector uses to drive its sidecar: the control API plus the mapped region.

Prefill (after the prompt's forward)::

    res = client.reserve_export(request_id, buffers, block_ids=..., num_tokens=..., ...)
    for spec in buffers: client.view(res.buffers[spec.name]) [:] = <bytes of that cache group>
    params = client.commit_export(res.transfer_id)      # -> the response's kv_transfer_params

Decode (a request carrying those params)::

    st = client.start_pull(params, wait_s=0.05)          # PullStatus; PullFailed if it failed
    while st.kv is None: st = client.poll_pull(st.pull_id, wait_s=0.05)   # or wait_pull(id)
    for b in st.kv.buffers.values(): <copy client.view(b) into the cache>
    client.release_pull(st.pull_id)

Blocking calls (safe from several threads); an asyncio engine runs them with
``asyncio.to_thread``. Pure stdlib: no torch, no engine imports. The calls go over the sidecar's
fast control socket (the same API without HTTP, on a unix socket beside the staging region, named
by ``/v1/info``) when this process can reach it, on pooled connections; else over HTTP on a
thread-local keep-alive connection.

A pull asked with a wait, of an export on this host (its params' ``remote_shm``), is copied by
this process itself into an extent its sidecar granted it, with no request before the copy
(``local_pull``; ``in_place=False`` turns it off): the sidecar pulls over shm anyway, and its
request and answer cost more than a copy of a few MiB.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dsv4_common.tracing import TRACEPARENT
from dsv4_kvtransfer.buffers import BufferSpec
from dsv4_kvtransfer.integrity import Fingerprint
from dsv4_kvtransfer.local_pull import FastConnection, Landed, LocalPuller
from dsv4_kvtransfer.pd_protocol import KVParamsError, RemotePrefillParams, shm_source
from dsv4_kvtransfer.staging import StagingRegion


class SidecarError(RuntimeError):
    """The sidecar refused a request (``status``, ``code``) or could not be reached."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class PullFailed(SidecarError):
    """A pull ended ``failed`` or ``expired``: ``reason`` says why (``auth``, ``timeout``,
    ``unknown_transfer``, ``connection``, ...). The engine falls back to its failure policy;
    ``pull_id`` (when the sidecar named it) is released like any other pull."""

    def __init__(self, reason: str, message: str, pull_id: str | None = None) -> None:
        super().__init__(0, reason, message)
        self.reason = reason
        self.pull_id = pull_id


@dataclass(frozen=True, slots=True)
class PlacedView:
    """A buffer in the staging region: absolute ``offset``, ``nbytes``, and its description."""

    spec: BufferSpec
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Reservation:
    transfer_id: str
    total_bytes: int
    buffers: dict[str, PlacedView]
    lease_expires_at: float


@dataclass(frozen=True, slots=True)
class PulledKV:
    pull_id: str
    buffers: dict[str, PlacedView]
    remote_meta: dict[str, Any]
    """What the prefill engine attached to the export (``engine_meta``, ``num_tokens``, ...)."""
    lease_expires_at: float


@dataclass(frozen=True, slots=True)
class PullStatus:
    """A pull that has not failed: ``pending``, or ``done`` with its ``kv``."""

    pull_id: str
    state: str
    bytes_done: int
    total_bytes: int
    kv: PulledKV | None
    """Where the KV is, once ``done`` (copy it out, then ``release_pull``)."""


def _placed(items: Iterable[Mapping[str, Any]]) -> dict[str, PlacedView]:
    out = {}
    for b in items:
        spec = BufferSpec.from_dict(b)
        out[spec.name] = PlacedView(spec, int(b["offset"]), spec.nbytes)
    return out


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


# after the fast socket could not be reached, HTTP only for this long, then ask /v1/info again
FAST_RETRY_S = 10.0


class _FastUnavailable(Exception):
    """The fast control socket cannot be reached: the call goes over HTTP."""


class SidecarClient:
    def __init__(
        self,
        url: str = "http://127.0.0.1:14580",
        timeout_s: float = 10.0,
        unix_socket: str | None = None,
        shm_dir: str | None = None,
        fast: bool = True,
        in_place: bool = True,
    ) -> None:
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.timeout_s = timeout_s
        self.unix_socket = unix_socket
        self._shm_dir = shm_dir
        self._local = threading.local()
        self._region: StagingRegion | None = None
        self._region_lock = threading.Lock()
        # the fast control socket: its path once /v1/info named one ("" none), idle connections
        self.fast = fast
        self._fast_path: str | None = None
        self._fast_checked = -FAST_RETRY_S
        self._fast_idle: list[FastConnection] = []
        self._fast_lock = threading.Lock()
        # same-host pulls this client copies itself into extents its sidecar grants it
        # (``local_pull``), where the fast socket is reachable and the sidecar pulls over shm
        self.in_place = in_place
        self._shm_dir_info: str | None = None
        self._pulls_shm = False  # the sidecar pulls over shm (/v1/info): it grants extents
        self._local_pull: LocalPuller | None = None
        self._views: dict[tuple[bytes, int], dict[str, PlacedView]] = {}

    # ---- HTTP ----------------------------------------------------------------------------------

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = (
                _UnixConnection(self.unix_socket, timeout)
                if self.unix_socket
                else http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            )
            self._local.conn = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        timeout: float = 0,
        traceparent: str | None = None,
    ) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        timeout = timeout or self.timeout_s
        if self.fast and self._fast_socket():
            try:
                return self._decode(*self._fast_call(method, path, data, traceparent, timeout))
            except _FastUnavailable:
                pass
        return self._decode(*self._http_call(method, path, data, traceparent, timeout))

    def _http_call(
        self, method: str, path: str, data: bytes | None, trace: str | None, timeout: float
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if trace is not None:  # tracing on: the sidecar's span joins the engine's trace
            headers[TRACEPARENT] = trace
        for attempt in (0, 1):
            conn = self._conn(timeout)
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                conn.close()
                self._local.conn = None
                # a kept-alive connection the server closed: retry once on a fresh one
                if attempt or isinstance(e, TimeoutError):
                    raise SidecarError(0, "unreachable", f"KV sidecar unreachable: {e}") from e
        raise AssertionError("unreachable")

    def _fast_socket(self) -> str | None:
        """The fast control socket's path, asking ``/v1/info`` (over HTTP) the first time and
        again a while after it could not be reached."""
        path = self._fast_path
        if path is None and time.monotonic() - self._fast_checked > FAST_RETRY_S:
            self._fast_checked = time.monotonic()
            self._fast_path = ""  # meanwhile (and if info names none): HTTP
            try:
                info = self._decode(*self._http_call("GET", "/v1/info", None, None, self.timeout_s))
            except SidecarError:  # not a sidecar's control API (its metrics port), or down
                return None
            self._learn(info)
            path = self._fast_path
        return path or None

    def _learn(self, info: Mapping[str, Any]) -> None:
        name = info.get("fast_socket")
        self._shm_dir_info = str(info.get("shm_dir") or "/dev/shm")
        self._pulls_shm = info.get("transport") == "shm"
        if isinstance(name, str) and name and "/" not in name:
            self._fast_path = os.path.join(self._shm_dir or str(info["shm_dir"]), name)
        else:
            self._fast_path = ""

    def _fast_call(
        self, method: str, path: str, data: bytes | None, trace: str | None, timeout: float
    ) -> tuple[int, bytes]:
        """Over the fast socket, on an idle connection (one that went stale is replaced once:
        the sidecar restarted); ``_FastUnavailable`` if no connection can be made."""
        sock_path = self._fast_path
        assert sock_path
        for attempt in (0, 1):
            with self._fast_lock:
                conn = self._fast_idle.pop() if self._fast_idle else None
            if conn is None:
                try:
                    conn = FastConnection(sock_path, min(timeout, self.timeout_s))
                except OSError:
                    self._fast_path = None  # HTTP for a while, then ask /v1/info again
                    raise _FastUnavailable() from None
            try:
                status, raw = conn.call(method, path, data, trace, timeout)
            except TimeoutError as e:
                conn.close()
                raise SidecarError(0, "unreachable", f"KV sidecar unreachable: {e}") from e
            except OSError as e:
                conn.close()
                if attempt:
                    raise SidecarError(0, "unreachable", f"KV sidecar unreachable: {e}") from e
                # a stale connection means the sidecar restarted: every idle one is stale too,
                # so the retry opens a fresh one (two stale ones in a row failed a pull)
                with self._fast_lock:
                    stale, self._fast_idle = self._fast_idle, []
                for c in stale:
                    c.close()
                continue
            with self._fast_lock:
                self._fast_idle.append(conn)
            return status, raw
        raise AssertionError("unreachable")

    @staticmethod
    def _decode(status: int, raw: bytes) -> dict[str, Any]:
        try:
            obj = json.loads(raw) if raw else {}
        except ValueError:
            raise SidecarError(status, "bad_response", raw[:200].decode("replace")) from None
        if status >= 400:
            err = obj.get("error", {}) if isinstance(obj, dict) else {}
            raise SidecarError(status, str(err.get("code")), str(err.get("message", obj)))
        if not isinstance(obj, dict):
            raise SidecarError(status, "bad_response", "expected a JSON object")
        return obj

    # ---- the staging region --------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        info = self.request("GET", "/v1/info")
        self._learn(info)
        return info

    def host_evictions(self, since: int) -> tuple[int, list[str], bool]:
        """Host-tier entries evicted from number ``since`` on: (the next number, their
        transfer ids, whether some before them are no longer known)."""
        r = self.request("GET", f"/v1/host-tier/evictions?since={since}")
        return int(r["next"]), [str(t) for t in r["transfer_ids"]], bool(r["lost"])

    def host_tier_moves(self, since: int) -> tuple[int, list[tuple[str, str | None]], bool]:
        """As ``host_evictions``, with every record in order: (transfer id, the medium its
        entry is in now: ``"DISK"``, ``"CPU"``, or None when it is gone)."""
        r = self.request("GET", f"/v1/host-tier/evictions?since={since}")
        moves = [(str(t), None if m is None else str(m)) for t, m in r.get("moves", [])]
        return int(r["next"]), moves, bool(r["lost"])

    def region(self, tag: str | None = None) -> StagingRegion:
        """The sidecar's staging region, mapped once. With ``tag`` (from a reservation or a
        finished pull), a mapping of an older region (the sidecar restarted) is replaced: KV
        must never be written into, or read from, a region the sidecar no longer serves."""
        with self._region_lock:
            if self._region is not None and tag is not None and self._region.tag_hex != tag:
                self._region.close()
                self._region = None
            if self._region is None:
                info = self.info()
                region = StagingRegion.attach(
                    str(info["shm_name"]), self._shm_dir or str(info["shm_dir"])
                )
                if tag is not None and region.tag_hex != tag:
                    region.close()
                    raise SidecarError(0, "restarted", "the KV sidecar restarted meanwhile")
                self._region = region
            return self._region

    def view(self, placed: PlacedView) -> memoryview:
        """Zero-copy view of a buffer in the staging region (``torch.frombuffer`` takes it)."""
        return self.region().view(placed.offset, placed.nbytes)

    def close(self) -> None:
        if self._local_pull is not None:
            self._local_pull.close()
        with self._fast_lock:
            idle, self._fast_idle = self._fast_idle, []
        for conn in idle:
            conn.close()
        with self._region_lock:
            if self._region is not None:
                self._region.close()
                self._region = None

    # ---- prefill side --------------------------------------------------------------------------

    def reserve_export(
        self,
        request_id: str,
        buffers: Iterable[BufferSpec],
        *,
        block_ids: Iterable[int] = (),
        num_tokens: int = 0,
        state_slot: int | None = None,
        cache_groups: Mapping[str, int] | None = None,
        engine_meta: Mapping[str, Any] | None = None,
        engine_id: str | None = None,
        lease_seconds: float | None = None,
        params_extra: Mapping[str, Any] | None = None,
        traceparent: str | None = None,
        fingerprint: Fingerprint | None = None,
        prefix_key: str | None = None,
    ) -> Reservation:
        """An extent for ``buffers``. ``params_extra``: fields to add to the ``kv_transfer_params``
        that ``commit_export`` returns (what the decode side checks before it pulls).
        ``fingerprint``: the writer's KV layout, in the manifest beside the checksums the
        sidecar computes at the commit (``dsv4_kvtransfer.integrity``).
        ``prefix_key``: an offer to the host tier, kept under that key's transfer id
        (``SidecarError`` 409 ``duplicate`` if the tier has it, ``no_host_tier`` if it has none
        or the entry is larger than it)."""
        body: dict[str, Any] = {
            "request_id": request_id,
            "buffers": [b.to_dict() for b in buffers],
            "block_ids": list(block_ids),
            "num_tokens": num_tokens,
            "state_slot": state_slot,
            "cache_groups": dict(cache_groups or {}),
            "engine_meta": dict(engine_meta or {}),
        }
        if engine_id is not None:
            body["engine_id"] = engine_id
        if lease_seconds is not None:
            body["lease_seconds"] = lease_seconds
        if params_extra:
            body["params_extra"] = dict(params_extra)
        if fingerprint is not None:
            body["fingerprint"] = fingerprint.to_dict()
        if prefix_key is not None:
            body["prefix_key"] = prefix_key
        r = self.request("POST", "/v1/exports", body, traceparent=traceparent)
        self.region(str(r["shm_tag"]))
        return Reservation(
            r["transfer_id"], int(r["total_bytes"]), _placed(r["buffers"]), r["lease_expires_at"]
        )

    def commit_export(self, transfer_id: str) -> dict[str, Any]:
        """-> the ``kv_transfer_params`` for the prefill response."""
        params = self.request("POST", f"/v1/exports/{transfer_id}/commit")["kv_transfer_params"]
        assert isinstance(params, dict)
        return params

    def abort_export(self, transfer_id: str) -> None:
        self.request("DELETE", f"/v1/exports/{transfer_id}")

    # ---- decode side ---------------------------------------------------------------------------

    def start_pull(
        self,
        kv_transfer_params: RemotePrefillParams | Mapping[str, Any],
        *,
        timeout_s: float | None = None,
        wait_s: float = 0.0,
        traceparent: str | None = None,
        fingerprint: Fingerprint | None = None,
    ) -> PullStatus:
        """Start pulling the KV the params name, and wait up to ``wait_s`` for it in the same
        request (one round trip fewer for small KV). ``PullFailed`` if it failed already. The
        sidecar runs a small pull asked with a wait during the request itself, so the answer
        may take up to the pull's ``timeout_s`` (never longer: its deadline ends it).
        ``fingerprint``: this engine's KV layout; an export of another one fails the pull
        (``fingerprint_mismatch``), as do bytes that are not what was written
        (``checksum_mismatch``): ``dsv4_kvtransfer.integrity``."""
        local = self._in_place() if wait_s > 0 and self.in_place else None
        if local is not None:
            landed = self._pull_here(local, kv_transfer_params, traceparent, fingerprint)
            if landed is not None:
                return landed
        params = (
            kv_transfer_params.to_dict()
            if isinstance(kv_transfer_params, RemotePrefillParams)
            else dict(kv_transfer_params)
        )
        body: dict[str, Any] = {"kv_transfer_params": params, "wait_s": wait_s}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if fingerprint is not None:
            body["fingerprint"] = fingerprint.to_dict()
        patience = self.timeout_s + wait_s + (timeout_s or 0.0)
        st = self._typed(
            self.request("POST", "/v1/pulls", body, timeout=patience, traceparent=traceparent)
        )
        if local is not None:
            local.after_fallback()
        return st

    def _in_place(self) -> LocalPuller | None:
        """The in-place puller, once the fast control socket is known (None: HTTP only)."""
        if self._local_pull is None and self.fast and self._fast_socket() and self._pulls_shm:
            assert self._fast_path
            self._local_pull = LocalPuller(
                self._fast_path,
                self._shm_dir or self._shm_dir_info or "/dev/shm",
                self.timeout_s,
                self.region,
            )
        return self._local_pull

    def _pull_here(
        self,
        local: LocalPuller,
        p: RemotePrefillParams | Mapping[str, Any],
        traceparent: str | None,
        fingerprint: Fingerprint | None,
    ) -> PullStatus | None:
        """The pull copied by this process (``local_pull``); None: the sidecar makes it."""
        if not isinstance(p, RemotePrefillParams):
            try:  # as strictly as the sidecar would (it answers the errors)
                p = RemotePrefillParams.from_dict(p)
            except KVParamsError:
                return None
        src = shm_source(p.extra)
        if src is None:
            return None
        n = p.remote_total_bytes
        got = local.pull(
            p.remote_transfer_id, n, p.remote_host, p.remote_port, src, traceparent, fingerprint
        )
        if got is None:
            return None
        kv = PulledKV(got.pull_id, self._placed_at(got), got.meta, got.lease_expires_at)
        return PullStatus(got.pull_id, "done", n, n, kv)

    def _placed_at(self, got: Landed) -> dict[str, PlacedView]:
        """The buffers of a layout at an offset (kept: grants come back to the same places)."""
        key = (got.raw_layout, got.offset)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 256:
                self._views.clear()
            views = self._views[key] = {
                b.spec.name: PlacedView(b.spec, got.offset + b.offset, b.spec.nbytes)
                for b in got.layout.buffers
            }
        return dict(views)

    def poll_pull(self, pull_id: str, wait_s: float = 0.0) -> PullStatus:
        """The pull's status, waiting up to ``wait_s`` while it is pending; ``PullFailed`` once
        it failed or its lease ran out."""
        if self._local_pull is not None:
            self._local_pull.confirm(pull_id)
        return self._typed(
            self.request(
                "GET", f"/v1/pulls/{pull_id}?wait={wait_s:g}", timeout=self.timeout_s + wait_s
            )
        )

    def wait_pull(self, pull_id: str, timeout_s: float = 60.0) -> PulledKV:
        """Block until the pull is done (-> where the KV is) or failed (``PullFailed``)."""
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            st = self.poll_pull(pull_id, wait_s=max(0.0, min(left, 10.0)))
            if st.kv is not None:
                return st.kv
            if left <= 0:
                raise PullFailed(
                    "timeout", f"pull {pull_id} still pending after {timeout_s}s", pull_id
                )

    def release_pull(self, pull_id: str) -> None:
        """The KV was copied out (or is no longer wanted): the sidecar frees it."""
        # a pull copied here is adopted and freed in one message, answered later (else its
        # adoption answered before this request: a release never overtakes it)
        if self._local_pull is not None and self._local_pull.release(pull_id):
            return
        self.request("DELETE", f"/v1/pulls/{pull_id}")

    def wait_adoptions(self) -> None:
        """Until the sidecar answered everything this client told it about pulls it copied
        itself (their adoptions and releases); nothing to wait for otherwise."""
        if self._local_pull is not None:
            self._local_pull.settle()

    def _typed(self, st: Mapping[str, Any]) -> PullStatus:
        return PullStatus(
            str(st["pull_id"]),
            str(st["state"]),
            int(st.get("bytes_done", 0)),
            int(st.get("total_bytes", 0)),
            self._finish(st),
        )

    def _finish(self, st: Mapping[str, Any]) -> PulledKV | None:
        """A finished pull's KV, ``PullFailed`` for a failed one, ``None`` while pending."""
        if st["state"] == "done":
            self.region(str(st["shm_tag"]))
            return PulledKV(
                str(st["pull_id"]),
                _placed(st["buffers"]),
                st.get("remote_meta", {}),
                st["lease_expires_at"],
            )
        if st["state"] != "pending":
            pull_id = st.get("pull_id")
            raise PullFailed(
                str(st.get("reason")), str(st.get("error")), str(pull_id) if pull_id else None
            )
        return None
