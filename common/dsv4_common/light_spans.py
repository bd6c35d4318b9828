"""Cheap spans for a hot path (the gateway's), exported as OTLP/HTTP protobuf without the SDK.

The OpenTelemetry SDK cost the gateway's event loop about 140 us of CPU per traced request
(``Tracer.start_span`` with its ``BoundedAttributes`` and sampler, ``Span.end`` through the span
processor, context attach) and its exporter thread about as much again, under the same GIL. Here
a span on the request path is a plain record: ids from ``random.getrandbits``, times from
``time.time_ns()``, the caller's attribute dict, the W3C ``traceparent`` formatted by hand. An
ended span is appended to a list; a background thread takes the list every ``schedule_s``,
encodes it as an ``ExportTraceServiceRequest`` by hand (the wire format is a few tags, varints
and lengths; attribute pairs repeat from request to request, so their encodings are cached) and
POSTs it with ``http.client``. The encoding is checked against the protobuf classes in the unit
tests.

Sampling is the SDK's default (parent-based, always on): a client's ``traceparent`` with the
sampled flag clear makes spans that are propagated (flag ``00``) but never exported.
"""

from __future__ import annotations

import atexit
import http.client
import logging
import random
import re
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from dsv4_common.tracing import MAX_QUEUED_SPANS, traces_url

log = logging.getLogger("dsv4.tracing")

KIND = {"internal": 1, "server": 2, "client": 3, "producer": 4, "consumer": 5}  # SpanKind + 1
STATUS_ERROR = 2
# W3C trace context, parsed the way OpenTelemetry's TraceContextTextMapPropagator does
_TRACEPARENT = re.compile(
    r"^\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\s*$"
)

Parent = tuple[int, int, bool]
"""A remote parent: (trace id, span id, sampled)."""


def parse_traceparent(value: str | None) -> Parent | None:
    """The parent a ``traceparent`` names, or None (absent or invalid: start a new trace)."""
    if not value:
        return None
    m = _TRACEPARENT.match(value)
    if m is None:
        return None
    version, trace, span, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace, 16), int(span, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)


class Span:
    """One span: started by ``Recorder.start``, exported once ``end`` is called (if sampled)."""

    __slots__ = (
        "_recorder",
        "attributes",
        "end_ns",
        "error",
        "kind",
        "name",
        "parent_id",
        "span_id",
        "start_ns",
        "trace_id",
    )

    def __init__(
        self,
        recorder: Recorder | None,
        trace_id: int,
        span_id: int,
        parent_id: int,
        name: str,
        kind: int,
        attributes: dict[str, Any],
        start_ns: int,
    ) -> None:
        self._recorder = recorder  # None: not sampled, never exported
        self.trace_id, self.span_id, self.parent_id = trace_id, span_id, parent_id
        self.name, self.kind, self.attributes = name, kind, attributes
        self.start_ns, self.end_ns = start_ns, 0
        self.error: str | None = None

    @property
    def sampled(self) -> bool:
        return self._recorder is not None

    def traceparent(self) -> str:
        """The W3C ``traceparent`` naming this span as the parent of the receiver's spans."""
        flags = "01" if self._recorder is not None else "00"
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{flags}"

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def fail(self, message: str) -> None:
        """Status ERROR with ``message`` (OpenTelemetry's ``StatusCode.ERROR``)."""
        self.error = message

    def end(self, end_ns: int | None = None) -> None:
        if self.end_ns:  # ended already
            return
        self.end_ns = max(end_ns or time.time_ns(), self.start_ns)
        if self._recorder is not None:
            self._recorder._ended(self)


class Recorder:
    """Starts spans and exports the ended ones in batches from a background thread.

    ``post(body)`` sends one encoded request (default: HTTP POST to ``url``); tests pass their
    own. ``schedule_s`` None: no thread, export only on ``flush``."""

    def __init__(
        self,
        url: str,
        service: str,
        attributes: Mapping[str, Any] | None = None,
        *,
        schedule_s: float | None = 0.5,
        max_queued: int = MAX_QUEUED_SPANS,
        max_batch: int = 2048,
        post: Callable[[bytes], None] | None = None,
    ) -> None:
        self.url = url
        self.max_queued, self.max_batch = max_queued, max_batch
        self.dropped = 0  # spans ended while ``max_queued`` were waiting: not exported
        self._done: list[Span] = []
        self._post = post or _HttpPost(url)
        self._export_lock = threading.Lock()
        self._cache: dict[tuple[str, type, Any], bytes] = {}
        resource = b"".join(
            _ld(1, _key_value(k, v))
            for k, v in {"service.name": service, **(attributes or {})}.items()
        )
        self._resource = _ld(1, resource)
        self._scope = _ld(1, _ld(1, b"dsv4"))  # InstrumentationScope(name="dsv4")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if schedule_s is not None:
            self._thread = threading.Thread(
                target=self._run, args=(schedule_s,), name="dsv4-span-export", daemon=True
            )
            self._thread.start()

    def start(
        self,
        name: str,
        parent: Span | Parent | None,
        attributes: dict[str, Any],
        kind: str = "internal",
        start_ns: int | None = None,
    ) -> Span:
        """A live span (the caller ends it) owning ``attributes``; ``parent`` None starts a trace."""
        recorder: Recorder | None = self
        if parent is None:
            trace_id, parent_id = random.getrandbits(128) or 1, 0
        elif isinstance(parent, Span):
            trace_id, parent_id = parent.trace_id, parent.span_id
            recorder = self if parent._recorder is not None else None
        else:
            trace_id, parent_id, sampled = parent
            recorder = self if sampled else None
        return Span(
            recorder,
            trace_id,
            random.getrandbits(64) or 1,
            parent_id,
            name,
            KIND[kind],
            attributes,
            start_ns or time.time_ns(),
        )

    def _ended(self, span: Span) -> None:
        # called on the request path: an append (atomic under the GIL, no lock)
        if len(self._done) < self.max_queued:
            self._done.append(span)
        else:
            self.dropped += 1

    # ---- the export side ----------------------------------------------------------------

    def _run(self, schedule_s: float) -> None:
        while not self._stop.wait(schedule_s):
            self.flush()

    def flush(self) -> None:
        """Export every span ended so far (from the caller's thread)."""
        with self._export_lock:
            # the swap: an append racing it lands in the list taken here, which is exported
            done, self._done = self._done, []
            for i in range(0, len(done), self.max_batch):
                batch = done[i : i + self.max_batch]
                try:
                    self._post(self.encode(batch))
                except Exception as e:  # a backend down must not stop the gateway: drop
                    log.warning(
                        "dropped %d spans: export to %s failed: %s", len(batch), self.url, e
                    )

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.flush()

    def encode(self, spans: list[Span]) -> bytes:
        """An OTLP ``ExportTraceServiceRequest`` holding ``spans`` (protobuf wire format)."""
        cache = self._cache
        if len(cache) > 4096:  # request ids never repeat: start over, the repeating ones return
            cache.clear()
        out = [self._scope]
        for s in spans:
            attrs = []
            for k, v in s.attributes.items():
                ck = (k, v.__class__, v)
                try:
                    kv = cache.get(ck)
                except TypeError:  # a list: not hashable, not cached
                    kv = _ld(9, _key_value(k, v))
                if kv is None:
                    kv = cache[ck] = _ld(9, _key_value(k, v))
                attrs.append(kv)
            body = b"".join(
                (
                    _IDS.pack(0x0A, 16, s.trace_id >> 64, s.trace_id & _U64, 0x12, 8, s.span_id),
                    _PARENT.pack(0x22, 8, s.parent_id) if s.parent_id else b"",
                    _ld(5, s.name.encode()),
                    _TIMES.pack(0x30, s.kind, 0x39, s.start_ns, 0x41, s.end_ns),
                    *attrs,
                    b""
                    if s.error is None
                    else _ld(15, _ld(2, s.error.encode()) + bytes((0x18, STATUS_ERROR))),
                )
            )
            out.append(_ld(2, body))
        return _ld(1, self._resource + _ld(2, b"".join(out)))


_U64 = (1 << 64) - 1
_IDS = struct.Struct(">BBQQBBQ")  # trace_id (field 1, 16 bytes), span_id (field 2, 8 bytes)
_PARENT = struct.Struct(">BBQ")  # parent_span_id (field 4)
_TIMES = struct.Struct("<BBBQBQ")  # kind (6, varint < 128), start (7) and end (8): fixed64


def _varint(n: int) -> bytes:
    n &= _U64  # int64: a negative number is its two's complement, 10 bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _key_value(key: str, value: Any) -> bytes:
    """A ``KeyValue`` with its ``AnyValue`` (string 1, bool 2, int 3, double 4, array 5)."""
    return _ld(1, key.encode()) + _ld(2, _any_value(value))


def _any_value(v: Any) -> bytes:
    if isinstance(v, bool):
        return bytes((0x10, int(v)))
    if isinstance(v, int):
        return b"\x18" + _varint(v)
    if isinstance(v, float):
        return b"\x21" + struct.pack("<d", v)
    if isinstance(v, list | tuple):  # ArrayValue: values (field 1)
        return _ld(5, b"".join(_ld(1, _any_value(x)) for x in v))
    return _ld(1, str(v).encode())


class _HttpPost:
    """POST to the OTLP/HTTP endpoint over one kept-alive connection (reopened after an error)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        u = urlsplit(url)
        self.path = u.path or "/"
        self.host, self.port, self.https = u.hostname or "", u.port, u.scheme == "https"
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def __call__(self, body: bytes) -> None:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self._conn = cls(self.host, self.port, timeout=self.timeout_s)
        try:
            self._conn.request("POST", self.path, body, {"Content-Type": "application/x-protobuf"})
            resp = self._conn.getresponse()
            answer = resp.read()
        except BaseException:
            self._conn.close()
            self._conn = None
            raise
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {answer[:200]!r}")


_lock = threading.Lock()
_recorders: dict[tuple[str, str], Recorder] = {}


def setup(
    endpoint: str | None, service: str, attributes: Mapping[str, Any] | None = None
) -> Recorder | None:
    """A recorder exporting to ``endpoint`` as ``service``, or None when ``endpoint`` is None
    (tracing off). One per (endpoint, service) per process, flushed at exit."""
    if endpoint is None:
        return None
    url = traces_url(endpoint)
    with _lock:
        recorder = _recorders.get((url, service))
        if recorder is None:
            recorder = _recorders[url, service] = Recorder(url, service, attributes)
            atexit.register(recorder.shutdown)
    return recorder


def flush() -> None:
    """Export what is waiting now (before a process exits on a signal)."""
    with _lock:
        recorders = list(_recorders.values())
    for r in recorders:
        r.flush()
