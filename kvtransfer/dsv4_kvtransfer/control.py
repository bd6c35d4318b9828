"""The local control API the engine drives (HTTP/1.1 + JSON on 127.0.0.1, or a unix socket).

    GET    /health                      liveness ({"status": "ok", ...})
    GET    /ready                       readiness: 200, or 503 while draining (SIGTERM)
    GET    /metrics                     Prometheus text
    GET    /v1/info                     staging region name and size, free bytes, counts
    POST   /v1/exports                  reserve an extent for a request's KV buffers
    POST   /v1/exports/{id}/commit      the engine wrote the buffers: start the lease, get params
    GET    /v1/exports/{id}             state of an export
    DELETE /v1/exports/{id}             abort (free now, or when the current reader finishes)
    POST   /v1/pulls                    pull the KV named by a decode request's params
    GET    /v1/pulls/{id}?wait=S        state; long-polls up to S seconds while pending
    DELETE /v1/pulls/{id}               the engine copied the KV out (or gives up): free it

Bodies are parsed into ``control_requests``; errors are the project's one error body
(``dsv4_common.errors.openai_error``: ``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from dsv4_common.errors import openai_error
from dsv4_common.tracing import TRACEPARENT
from dsv4_kvtransfer.control_requests import ExportRequest, PullRequest, parse_wait
from dsv4_kvtransfer.errors import ApiError
from dsv4_kvtransfer.sidecar import Sidecar

MAX_BODY = 4 << 20


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dsv4-kv-sidecar"
    sidecar: Sidecar  # set on the subclass built per server
    probes_only = False  # the metrics listener: /health and /metrics, nothing that changes state
    _raw = b""  # the request's body

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

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, status: int, code: str, message: str, param: str | None = None) -> None:
        self._json(status, openai_error(status, message, code=code, param=param))

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

    def _body(self) -> dict[str, Any]:
        raw = self._raw or b"{}"
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise ApiError(400, "bad_json", "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "bad_json", "the request body must be a JSON object")
        return body

    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        parts = [p for p in url.path.split("/") if p]
        sc = self.sidecar
        try:
            self._raw = self._read_body()
            if method == "GET" and parts == ["health"]:
                return self._json(200, sc.health())
            if method == "GET" and parts == ["ready"]:
                if sc.ready:
                    return self._json(200, {"status": "ready"})
                return self._error(503, "draining", "the KV sidecar is shutting down")
            if method == "GET" and parts == ["metrics"]:
                return self._send(200, sc.metrics.render(), CONTENT_TYPE_LATEST)
            if self.probes_only:
                return self._error(404, "not_found", "only /health, /ready and /metrics here")
            if method == "GET" and parts == ["v1", "info"]:
                return self._json(200, sc.info())
            if parts[:2] == ["v1", "exports"]:
                if method == "POST" and len(parts) == 2:
                    req = ExportRequest.from_body(self._body())
                    return self._json(200, sc.exports.reserve(req, self.headers.get(TRACEPARENT)))
                if method == "POST" and len(parts) == 4 and parts[3] == "commit":
                    return self._json(200, sc.exports.commit(parts[2]))
                if method == "GET" and len(parts) == 3:
                    return self._json(200, sc.exports.status(parts[2]))
                if method == "DELETE" and len(parts) == 3:
                    return self._json(200, sc.exports.abort(parts[2]))
            if parts[:2] == ["v1", "pulls"]:
                if method == "POST" and len(parts) == 2:
                    pull = PullRequest.from_body(self._body())
                    return self._json(200, sc.puller.start(pull, self.headers.get(TRACEPARENT)))
                if method == "GET" and len(parts) == 3:
                    wait = parse_wait(parse_qs(url.query).get("wait", [None])[0])
                    return self._json(200, sc.puller.status(parts[2], wait))
                if method == "DELETE" and len(parts) == 3:
                    return self._json(200, sc.puller.release(parts[2]))
            self._error(404, "not_found", f"no route {method} {url.path}")
        except ApiError as e:
            self._error(e.status, e.code, str(e), e.param)
        except Exception as e:  # a bug here must not take the sidecar down
            logging.getLogger("dsv4.kv.control").exception("control API error")
            self._error(500, "internal", f"{type(e).__name__}: {e}")

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
        self._threads: list[threading.Thread] = []

    def _servers(self) -> list[socketserver.BaseServer]:
        return [s for s in (self.http, self.unix, self.metrics) if s is not None]

    def start(self) -> None:
        for srv in self._servers():
            t = threading.Thread(target=srv.serve_forever, name="kv-control", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        for srv in self._servers():
            srv.shutdown()
            srv.server_close()
        if self.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)
