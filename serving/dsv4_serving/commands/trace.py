"""``dsv4 trace <request-id>``: where one request's time went, from the trace backend.

The gateway returns each request's ``X-Request-Id`` and puts it on its span
(``dsv4.request_id``); this finds that span's trace in Jaeger's query API and prints it as a
text waterfall (``traces.waterfall``): gateway routing, prefill engine (queue, chunks, KV
export), the sidecars' lease and transfer, decode engine (KV pull, decode loop).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request

from dsv4_serving.traces.query import GATEWAY_SERVICE, TraceNotFound, fetch
from dsv4_serving.traces.waterfall import parse_jaeger, render


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
