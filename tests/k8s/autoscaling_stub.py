"""A stand-in for the gateway, engine and sidecar metrics the autoscaler reads, for the k8s tests
(kwok pods run no processes): a real HTTP server on 127.0.0.1 whose answers the test sets.

``/metrics``: the gateway's latency histograms (vLLM's names; every scrape adds a steady
trickle of fast requests, so the window is never empty), the engine's queue gauges (what a
drain reads from its victim) and the sidecar's held exports. ``/instances``: the gateway's view
of one prefill and one decode engine with the waiting counts the test sets. ``POST /drain``
and ``DELETE /drain``: answered as an engine does (``running`` in flight, ``migrating`` of them
asked to move) and recorded in ``drain_calls`` (method, body), for the migration drain.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class MetricsStub:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prefill_waiting = 0.0
        self.decode_waiting = 0.0
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "", buckets=BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "", buckets=BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "", registry=r)
        self.exports = Gauge("dsv4_kv_active_exports", "", registry=r)
        self.scrapes = 0
        self.migrating = 0
        self.in_flight = 0.0
        self.drain_calls: list[tuple[str, Any]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    body, ctype = stub._metrics(), "text/plain; version=0.0.4"
                elif self.path == "/instances":
                    body, ctype = json.dumps(stub._instances()).encode(), "application/json"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                if self.path != "/drain":
                    self.send_error(404)
                    return
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer(stub._drain("POST", json.loads(raw) if raw.strip() else None))

            def do_DELETE(self) -> None:
                if self.path != "/drain":
                    self.send_error(404)
                    return
                self._answer(stub._drain("DELETE", None))

            def _answer(self, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> MetricsStub:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def set(self, **values: float) -> None:
        """prefill_waiting, decode_waiting (the gateway's view); running, waiting, exports (what
        the drained instance's engine and sidecar report)."""
        with self.lock:
            for key, value in values.items():
                if key in ("prefill_waiting", "decode_waiting"):
                    setattr(self, key, value)
                else:
                    getattr(self, key).set(value)
                if key == "running":
                    self.in_flight = value

    def _metrics(self) -> bytes:
        with self.lock:
            self.scrapes += 1
            for _ in range(25):  # a fast, steady trickle: 100 ms TTFT, 20 ms per token
                self.ttft.observe(0.08)
                self.itl.observe(0.02)
            return generate_latest(self.registry)

    def _drain(self, method: str, body: Any) -> dict[str, Any]:
        with self.lock:
            self.drain_calls.append((method, body))
            if method == "DELETE":
                return {"draining": False}
            return {
                "draining": True,
                "migrating": self.migrating,
                "in_flight": int(self.in_flight),
                "kv": True,
            }

    def drains(self, method: str) -> list[Any]:
        """The bodies of the ``method`` calls to ``/drain`` so far."""
        with self.lock:
            return [b for m, b in self.drain_calls if m == method]

    def _instances(self) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {
                    "url": f"http://{role}-{i}:8000",
                    "role": role,
                    "healthy": True,
                    "ranks": [{"waiting": waiting, "running": 0.0, "kv_usage": 0.0}],
                }
                for i, (role, waiting) in enumerate(
                    (("prefill", self.prefill_waiting), ("decode", self.decode_waiting))
                )
            ]
