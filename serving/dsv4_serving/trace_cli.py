"""``dsv4 trace <request-id>``: where one request's time went, from the trace backend.

The gateway returns each request's ``X-Request-Id`` and puts it on its span
(``dsv4.request_id``); this finds that span's trace in Jaeger's query API and prints it as a
text waterfall (``trace_waterfall``): gateway routing, prefill engine (queue, chunks, KV
export), the sidecars' lease and transfer, decode engine (KV pull, decode loop).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from dsv4_serving.trace_waterfall import parse_jaeger, render

GATEWAY_SERVICE = "dsv4-gateway"


class TraceNotFound(LookupError):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("request_id", help="the request's X-Request-Id (the gateway returns it)")
    p.add_argument(
        "--jaeger-url",
        default="http://127.0.0.1:16686",
        help="Jaeger's query API (default http://127.0.0.1:16686)",
    )
    p.add_argument(
        "--service",
        default=GATEWAY_SERVICE,
        help=f"service whose span carries the request id (default {GATEWAY_SERVICE})",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="keep asking up to S seconds while the trace is not (completely) there yet",
    )
    p.add_argument("--width", type=int, default=32, help="bar width in characters (default 32)")
    p.add_argument("--json", action="store_true", help="print the backend's trace JSON instead")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def find_trace(jaeger_url: str, request_id: str, service: str = GATEWAY_SERVICE) -> dict[str, Any]:
    """The newest trace whose ``service`` span has ``dsv4.request_id == request_id``."""
    query = urllib.parse.urlencode(
        {
            "service": service,
            "tags": json.dumps({"dsv4.request_id": request_id}),
            "lookback": "24h",
            "limit": 20,
        }
    )
    found = _get(f"{jaeger_url.rstrip('/')}/api/traces?{query}").get("data") or []
    if not found:
        raise TraceNotFound(f"no trace of request {request_id!r} in {jaeger_url}")
    newest: dict[str, Any] = max(
        found, key=lambda t: max((s["startTime"] for s in t.get("spans", [])), default=0)
    )
    # the search may answer with only the spans that matched: fetch the whole trace
    full = _get(f"{jaeger_url.rstrip('/')}/api/traces/{newest['traceID']}").get("data") or []
    return full[0] if full else newest


def fetch(
    jaeger_url: str, request_id: str, service: str = GATEWAY_SERVICE, wait_s: float = 0.0
) -> dict[str, Any]:
    """``find_trace``, retried up to ``wait_s`` while nothing is found or the span count still
    grows (components export in batches, a fraction of a second apart)."""
    deadline = time.monotonic() + wait_s
    last: dict[str, Any] | None = None
    while True:
        try:
            trace = find_trace(jaeger_url, request_id, service)
            if last is not None and len(trace.get("spans", [])) == len(last.get("spans", [])):
                return trace
            last = trace
        except TraceNotFound:
            if time.monotonic() >= deadline:
                raise
        if time.monotonic() >= deadline:
            if last is None:
                raise TraceNotFound(f"no trace of request {request_id!r} in {jaeger_url}")
            return last
        time.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    if args.width < 8:
        print("dsv4 trace: --width must be at least 8", file=sys.stderr)
        return 2
    try:
        trace = fetch(args.jaeger_url, args.request_id, args.service, args.wait)
    except TraceNotFound as e:
        print(f"dsv4 trace: {e}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"dsv4 trace: --jaeger-url {args.jaeger_url}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(trace, indent=1))
        return 0
    spans = parse_jaeger(trace)
    title = (
        f"trace {trace.get('traceID')}  request {args.request_id}  "
        f"{len(spans)} spans, {len({s.service for s in spans})} services"
    )
    sys.stdout.write(render(spans, args.width, title))
    return 0
