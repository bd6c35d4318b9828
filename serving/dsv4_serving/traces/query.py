"""Finding one request's trace in Jaeger's query API: the gateway puts the request's
``X-Request-Id`` on its span (``dsv4.request_id``); ``fetch`` returns the whole trace holding it."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from typing import Any

GATEWAY_SERVICE = "dsv4-gateway"


class TraceNotFound(LookupError):
    pass


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
