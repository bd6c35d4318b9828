"""The local control API the engine drives (HTTP/1.1 + JSON on 127.0.0.1, or a unix socket).

    GET    /health                      liveness ({"status": "ok", ...})
    GET    /ready                       readiness: 200, or 503 while draining (SIGTERM)
    GET    /metrics                     Prometheus text
    GET    /v1/info                     staging region name and size, free bytes, counts
    GET    /v1/host-tier/evictions?since=N  host-tier entries evicted or moved from number N on
    POST   /v1/exports                  reserve an extent for a request's KV buffers
    POST   /v1/exports/{id}/commit      the engine wrote the buffers: start the lease, get params
    GET    /v1/exports/{id}             state of an export
    DELETE /v1/exports/{id}             abort (free now, or when the current reader finishes)
    POST   /v1/pulls                    pull the KV named by a decode request's params
    GET    /v1/pulls/{id}?wait=S        state; long-polls up to S seconds while pending
    DELETE /v1/pulls/{id}               the engine copied the KV out (or gives up): free it

Bodies are parsed into ``control_requests``; errors are the project's one error body
(``dsv4_common.errors.openai_error``: ``{"error": {"message", "type", "param", "code"}}``).

The same API without HTTP (``FastControlServer``): a unix socket beside the staging region
(``<shm_dir>/<shm_name>.ctl``, mode 0600 as the region), named in ``/v1/info`` as
``fast_socket``; the engine's client uses it when it can reach it, HTTP otherwise. A request is
``u32 length`` + ``METHOD TARGET[ TRACEPARENT]\n`` + the body; an answer ``u16 status`` +
``u32 length`` + the body HTTP would have answered (always JSON on the routes a client uses).
Parsing an HTTP request (``http.server`` builds an ``email`` message of its headers) cost more
than a small pull's bookkeeping; this one is a split.

Only on the fast socket, **grants** (``local_pull``): an extent of the region held for the
client on that connection (``POST /v1/grants``), which it copies a same-host pull into itself
and then has adopted as that pull (``POST /v1/grants/{id}/adopt``: from then on a landed pull
under a lease) or gives back (``DELETE /v1/grants/{id}``). A grant is freed when its connection
ends, after every request the client wrote before it closed was served.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from dsv4_common.errors import openai_error
from dsv4_common.tracing import TRACEPARENT
from dsv4_kvtransfer.config import FAST_SUFFIX
from dsv4_kvtransfer.control_requests import (
    FAST_MAX_LINE,
    FAST_REPLY,
    FAST_REQUEST,
    MAX_GRANT_BYTES,
    ExportRequest,
    PullRequest,
    parse_wait,
)
from dsv4_kvtransfer.errors import ApiError
from dsv4_kvtransfer.ledger import LedgerError
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_kvtransfer.sidecar import Sidecar

MAX_BODY = 4 << 20
JSON = "application/json"
# sockaddr_un's sun_path holds 108 bytes with the terminating NUL
UNIX_PATH_MAX = 107
# grants (fast socket only: one lives as long as the connection that holds it)
GRANTS = "/v1/grants"
MAX_GRANTS = 4


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dsv4-kv-sidecar"
    sidecar: Sidecar  # set on the subclass built per server
    probes_only = False  # the metrics listener: /health and /metrics, nothing that changes state
    _raw = b""  # the request's body
    # a buffered response (flushed after each request): headers and body leave in one write,
    # one syscall and one wake-up of the client instead of two
    wbufsize = 64 << 10

    def setup(self) -> None:
        super().setup()
        # headers and body go out in two writes: without this, Nagle's algorithm holds the body
        # for the client's delayed ACK (~40 ms per request)
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        logging.getLogger("dsv4.kv.control").debug("%s " + format, self.client_address, *args)

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, param: str | None = None) -> None:
        self._send(status, _error_body(status, code, message, param))

    def _read_body(self) -> bytes:
        """Every request's body comes off the connection, wanted or not: bytes left unread would
        be taken for the next request on this keep-alive connection (found by fuzzing)."""
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise ApiError(400, "bad_request", "bad Content-Length") from None
        if not 0 <= n <= MAX_BODY:
            self.close_connection = True
            raise ApiError(413, "too_large", f"request body over {MAX_BODY} bytes")
        return self.rfile.read(n) if n else b""

    def _route(self, method: str) -> None:
        try:
            self._raw = self._read_body()
        except ApiError as e:
            return self._error(e.status, e.code, str(e), e.param)
        after: list[Callable[[], None]] = []
        status, body, ctype = route(
            self.sidecar,
            method,
            self.path,
            self._raw,
            self.headers.get(TRACEPARENT),
            self.probes_only,
            after,
        )
        self._send(status, body, ctype)
        if after:
            self.wfile.flush()
            _after_answer(after)

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    # answered (404, the error body) rather than http.server's 501 page
    def do_PUT(self) -> None:
        self._route("PUT")

    def do_PATCH(self) -> None:
        self._route("PATCH")


def _after_answer(after: list[Callable[[], None]]) -> None:
    """What waited for the answer to go out. The engine that asked was just woken to read the
    answer, maybe on this core: let it run first (with a core to spare this returns at once)."""
    os.sched_yield()
    for f in after:
        try:
            f()
        except Exception:  # the answer is out: a bug here must not end the connection
            logging.getLogger("dsv4.kv.control").exception("after an answer")


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    return _json(openai_error(status, message, code=code, param=param))


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise ApiError(400, "bad_json", "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_json", "the request body must be a JSON object")
    return body


def route(
    sc: Sidecar,
    method: str,
    target: str,
    raw: bytes,
    traceparent: str | None = None,
    probes_only: bool = False,
    after: list[Callable[[], None]] | None = None,
) -> tuple[int, bytes, str]:
    """One control request (``target``: path and query) -> (status, body, content type): the
    one dispatch behind the HTTP API and the fast socket. ``after``: the caller runs these once
    the answer went out (None: they run at once)."""
    url = urlsplit(target)
    parts = [p for p in url.path.split("/") if p]
    try:
        if method == "GET" and parts == ["health"]:
            return 200, _json(sc.health()), JSON
        if method == "GET" and parts == ["ready"]:
            if sc.ready:
                return 200, _json({"status": "ready"}), JSON
            raise ApiError(503, "draining", "the KV sidecar is shutting down")
        if method == "GET" and parts == ["metrics"]:
            return 200, sc.metrics.render(), CONTENT_TYPE_LATEST
        if probes_only:
            raise ApiError(404, "not_found", "only /health, /ready and /metrics here")
        if method == "GET" and parts == ["v1", "info"]:
            return 200, _json(sc.info()), JSON
        if method == "GET" and parts == ["v1", "host-tier", "evictions"]:
            since = parse_qs(url.query).get("since", ["0"])[0]
            if not since.isdigit():
                raise ApiError(400, "invalid_since", "since must be a whole number >= 0")
            return 200, _json(sc.store.host_evictions.since(int(since)).to_dict()), JSON
        if parts[:2] == ["v1", "exports"]:
            if method == "POST" and len(parts) == 2:
                req = ExportRequest.from_body(_parse_body(raw))
                return 200, _json(sc.exports.reserve(req, traceparent)), JSON
            if method == "POST" and len(parts) == 4 and parts[3] == "commit":
                return 200, _json(sc.exports.commit(parts[2])), JSON
            if method == "GET" and len(parts) == 3:
                return 200, _json(sc.exports.status(parts[2])), JSON
            if method == "DELETE" and len(parts) == 3:
                return 200, _json(sc.exports.abort(parts[2])), JSON
        if parts[:2] == ["v1", "pulls"]:
            if method == "POST" and len(parts) == 2:
                pull = PullRequest.from_body(_parse_body(raw))
                return 200, _json(sc.puller.start(pull, traceparent, after)), JSON
            if method == "GET" and len(parts) == 3:
                wait = parse_wait(parse_qs(url.query).get("wait", [None])[0])
                return 200, _json(sc.puller.status(parts[2], wait)), JSON
            if method == "DELETE" and len(parts) == 3:
                return 200, _json(sc.puller.release(parts[2])), JSON
        raise ApiError(404, "not_found", f"no route {method} {url.path}")
    except ApiError as e:
        return e.status, _error_body(e.status, e.code, str(e), e.param), JSON
    except Exception as e:  # a bug here must not take the sidecar down
        logging.getLogger("dsv4.kv.control").exception("control API error")
        return 500, _error_body(500, "internal", f"{type(e).__name__}: {e}"), JSON


class FastControlServer:
    """The control API on a unix socket without HTTP (see the module's docstring): a thread per
    connection, each request answered in order. Only this sidecar's user may connect (the socket
    is 0600, as is the region it hands out)."""

    def __init__(self, sidecar: Sidecar, path: str) -> None:
        self.sidecar = sidecar
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a sidecar of the same name that was killed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)  # before listen: nobody connects in between
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name="kv-fast-control", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stopped:
                    return
                continue
            with self._lock:
                if self._stopped:
                    conn.close()
                    return
                self._open.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="kv-fast-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        log = logging.getLogger("dsv4.kv.control")
        rfile = conn.makefile("rb")
        grants: set[str] = set()  # held by this connection's client (freed when it goes)
        gone = False  # the client stopped reading: only its adoptions are still honoured
        try:
            while True:
                head = rfile.read(FAST_REQUEST.size)
                if len(head) < FAST_REQUEST.size:
                    return  # the client went away
                (n,) = FAST_REQUEST.unpack(head)
                if n > MAX_BODY + FAST_MAX_LINE:
                    log.warning("fast control: a request of %d bytes; closing", n)
                    return
                msg = rfile.read(n)
                if len(msg) < n:
                    return
                line, _, raw = msg.partition(b"\n")
                words = line.decode("latin-1").split(" ")
                if len(line) > FAST_MAX_LINE or len(words) not in (2, 3):
                    log.warning("fast control: a malformed request line; closing")
                    return
                trace = words[2] if len(words) == 3 else None
                after: list[Callable[[], None]] = []
                if words[1].startswith(GRANTS):
                    status, body = self._grants(grants, words[0], words[1], raw, trace, after)
                elif gone:
                    continue
                else:
                    status, body, _ = route(
                        self.sidecar, words[0], words[1], raw, trace, False, after
                    )
                if not gone:
                    try:
                        conn.sendall(FAST_REPLY.pack(status, len(body)) + body)
                    except OSError:
                        # an adoption sent before the client closed must still land: its engine
                        # may be reading that extent (the grant is freed only below)
                        gone = True
                if after:
                    _after_answer(after)
        except OSError as e:
            log.debug("fast control connection: %s", e)
        finally:
            for gid in grants:
                self.sidecar.store.drop_grant(gid)
            with self._lock:
                self._open.discard(conn)
            rfile.close()
            with contextlib.suppress(OSError):
                conn.close()

    def _grants(
        self,
        grants: set[str],
        method: str,
        target: str,
        raw: bytes,
        trace: str | None,
        after: list[Callable[[], None]],
    ) -> tuple[int, bytes]:
        """The grants of this connection (``local_pull``): ``POST /v1/grants {bytes}`` an
                extent to copy a same-host pull into; ``POST /v1/grants/{id}/adopt`` (a line of JSON,
                then the export's manifest) the pull that landed there, with a new grant if ``want``;
                ``DELETE /v1/grants/{id}`` give it back. (The adoption's line is a list, not an object:
        the client writes it on the pull's path.)"""
        sc = self.sidecar
        parts = [p for p in target.split("/") if p]
        try:
            if method == "POST" and len(parts) == 2:
                return 200, _json(self._grant(grants, _parse_body(raw).get("bytes")))
            if method == "POST" and len(parts) == 4 and parts[3] == "adopt":
                gid = parts[2]
                if gid not in grants:
                    raise ApiError(404, "unknown_grant", f"no grant {gid} on this connection")
                # [transfer id, host, port, bytes, seconds, copy seconds, want, release], then
                # the manifest
                line, _, manifest = raw.partition(b"\n")
                tid, host, port, n, seconds, data_s, want, release = json.loads(line)
                params = RemotePrefillParams(
                    "-", "-", (), str(host), int(port), str(tid), 0.0, 0, int(n)
                )
                timing = (float(seconds), float(data_s))
                after.append(sc.puller.adopt(gid, params, manifest, timing, trace))
                grants.discard(gid)
                out: dict[str, Any] = {"pull_id": gid}
                if release:  # the engine is done with it already: its successor takes its place
                    out["freed"] = sc.puller.release(gid)["freed"]
                if want:
                    try:
                        out["grant"] = self._grant(grants, want)
                    except ApiError as e:
                        out["grant_error"] = e.code
                return 200, _json(out)
            if method == "DELETE" and len(parts) == 3:
                freed = parts[2] in grants and sc.store.drop_grant(parts[2])
                grants.discard(parts[2])
                return 200, _json({"freed": freed})
            raise ApiError(404, "not_found", f"no route {method} {target}")
        except ApiError as e:
            return e.status, _error_body(e.status, e.code, str(e), e.param)
        except (KeyError, TypeError, ValueError) as e:  # the grant, if any, stays as it was
            logging.getLogger("dsv4.kv.control").error("fast control %s %s: %r", method, target, e)
            return 400, _error_body(400, "bad_request", f"{type(e).__name__}: {e}")

    def _grant(self, grants: set[str], n: object) -> dict[str, Any]:
        sc = self.sidecar
        if sc.cfg.transport != "shm":
            raise ApiError(409, "unsupported", "this sidecar does not pull over shm")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_GRANT_BYTES:
            raise ApiError(400, "bad_request", f"bytes must be in (0, {MAX_GRANT_BYTES}]", "bytes")
        if len(grants) >= MAX_GRANTS:
            raise ApiError(409, "too_many_grants", f"{MAX_GRANTS} grants held already")
        u = sc.store.usage()
        # the sidecar's own pulls come first (the host tier's entries give way to either)
        if u.free_bytes + u.cached_bytes - n < u.staging_bytes // 4:
            raise ApiError(507, "staging_full", f"no grant of {n} bytes: the region is busy")
        gid = secrets.token_hex(12)
        try:
            imp = sc.store.grant(gid, n)
        except LedgerError as e:
            raise ApiError(507, e.code, str(e)) from None
        grants.add(gid)
        return {
            "grant_id": gid,
            "offset": imp.offset,
            "capacity": imp.capacity,
            "shm_tag": sc.store.region.tag_hex,
            "lease_seconds": sc.cfg.lease_seconds,
        }

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            conns = list(self._open)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def fast_socket_path(shm_dir: str, shm_name: str) -> str | None:
    """Where the fast control socket of a region lives (None: the path is too long for one)."""
    path = os.path.join(shm_dir, shm_name + FAST_SUFFIX)
    return path if len(os.fsencode(path)) <= UNIX_PATH_MAX else None


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, _ = self.socket.accept()
        # BaseHTTPRequestHandler wants a (host, port) client address
        return sock, ("unix", 0)


class ControlServer:
    """The control API on TCP (and optionally a unix socket), each served by a thread."""

    def __init__(
        self,
        sidecar: Sidecar,
        host: str,
        port: int,
        unix_path: str | None = None,
        metrics_addr: tuple[str, int] | None = None,
    ) -> None:
        self.sidecar = sidecar
        handler = type("Handler", (_Handler,), {"sidecar": sidecar})
        self.http = ThreadingHTTPServer((host, port), handler)
        self.http.daemon_threads = True
        self.port = int(self.http.server_address[1])
        self.unix: _UnixHTTPServer | None = None
        self.unix_path = unix_path
        if unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(unix_path)
            self.unix = _UnixHTTPServer(unix_path, handler)
        # /health and /metrics for Prometheus and probes from outside the pod; the control
        # API itself stays on loopback (it is not authenticated)
        self.metrics: ThreadingHTTPServer | None = None
        self.metrics_port: int | None = None
        if metrics_addr is not None:
            probes = type("ProbeHandler", (_Handler,), {"sidecar": sidecar, "probes_only": True})
            self.metrics = ThreadingHTTPServer(metrics_addr, probes)
            self.metrics.daemon_threads = True
            self.metrics_port = int(self.metrics.server_address[1])
        self.fast: FastControlServer | None = None
        cfg = sidecar.cfg
        path = fast_socket_path(cfg.shm_dir, cfg.shm_name) if cfg.fast_control else None
        if path is not None:
            try:
                self.fast = FastControlServer(sidecar, path)
            except OSError as e:  # HTTP still serves everything
                logging.getLogger("dsv4.kv.control").warning(
                    "no fast control socket at %s: %s", path, e
                )
        self._threads: list[threading.Thread] = []

    def _servers(self) -> list[socketserver.BaseServer]:
        return [s for s in (self.http, self.unix, self.metrics) if s is not None]

    def start(self) -> None:
        if self.fast is not None:
            self.fast.start()
            self.sidecar.fast_socket = os.path.basename(self.fast.path)
        for srv in self._servers():
            t = threading.Thread(target=srv.serve_forever, name="kv-control", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        if self.fast is not None:
            self.fast.stop()
        for srv in self._servers():
            srv.shutdown()
            srv.server_close()
        if self.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)
