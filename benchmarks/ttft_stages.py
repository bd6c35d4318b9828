"""Where a PD request's time to first token goes, from its trace (``docs/tracing.md``).

A request's trace is cut at its milestones into consecutive stages, so they add up to its
TTFT as the traces see it (the gateway's span start to the end of the decode engine's first
step, the one that samples the first token):

  route         gateway: arrival to the prefill attempt's start (parse, hash, score)
  prefill_queue the prefill engine's queue: the attempt's start to the request admitted or
                parked for a prefix pull (the HTTP hop, tokenizing, the wait for a step)
  prefix_pull   parked until the pulled prefix is in its blocks (0 without a pull)
  prefill_wait  between the queue (or the pull) and its first prefill chunk: steps of other
                requests it waited for
  prefill       its first prefill chunk's start to its last one's end (the steps computing
                its new tokens; a step holds other requests' tokens too)
  export        last chunk's end to the prefill answer at the gateway: the KV copied to the
                sidecar (a few ms), then the held answer waits until the core takes the
                export's result, after the step that runs meanwhile (another request's
                chunk, when the engine is busy), then the front end and the HTTP reply
  handoff       the prefill answer to the decode attempt's start (gateway)
  decode_kv     the decode attempt's start until its KV is in (HTTP, queue, the pull)
  first_step    from there to the end of the decode's first step (the first token)

Pure: Jaeger's JSON in (``traces.waterfall.parse_jaeger``), milliseconds out; ``fetch_window``
asks a Jaeger query API for the traces of a time window.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

from dsv4_serving.traces.query import GATEWAY_SERVICE
from dsv4_serving.traces.waterfall import Span, parse_jaeger

STAGES = (
    "route",
    "prefill_queue",
    "prefix_pull",
    "prefill_wait",
    "prefill",
    "export",
    "handoff",
    "decode_kv",
    "first_step",
)
PREFILL, DECODE = "dsv4-engine-prefill", "dsv4-engine-decode"


def _one(spans: Iterable[Span], service: str, name: str) -> Span | None:
    return next((s for s in spans if s.service == service and s.name == name), None)


def stages(spans: Sequence[Span]) -> dict[str, float] | None:
    """One PD request's stages in ms (``STAGES`` and ``ttft``), None when its trace is not
    a whole PD request that reached its first token (no decode step, a retry: two prefill
    attempts, or spans missing)."""
    root = next((s for s in spans if s.parent_id is None and s.service == GATEWAY_SERVICE), None)
    attempts = [s for s in spans if s.name == "dsv4.gateway.prefill"]
    decode_att = [s for s in spans if s.name == "dsv4.gateway.decode"]
    queue = _one(spans, PREFILL, "dsv4.engine.queue")
    chunks = sorted(
        (s for s in spans if s.service == PREFILL and s.name == "dsv4.engine.prefill_chunk"),
        key=lambda s: s.start_us,
    )
    first = sorted(
        (s for s in spans if s.service == DECODE and s.name == "dsv4.engine.prefill_chunk"),
        key=lambda s: s.start_us,
    )
    kv_in = _one(spans, DECODE, "dsv4.kv.pull")
    if root is None or len(attempts) != 1 or len(decode_att) != 1 or queue is None:
        return None
    if not chunks or not first or kv_in is None:
        return None
    pre, dec = attempts[0], decode_att[0]
    pull = _one(spans, PREFILL, "dsv4.kv.pull")
    admitted = pull.start_us if pull is not None else queue.end_us
    pulled = pull.end_us if pull is not None else admitted
    marks = [
        root.start_us,
        pre.start_us,
        admitted,
        pulled,
        chunks[0].start_us,
        chunks[-1].end_us,
        pre.end_us,
        dec.start_us,
        kv_in.end_us,
        first[0].end_us,
    ]
    out = {name: (b - a) / 1000 for name, a, b in zip(STAGES, marks[:-1], marks[1:], strict=True)}
    out["ttft"] = (marks[-1] - marks[0]) / 1000
    out["prefill_tokens"] = float(
        sum(int(c.attributes.get("dsv4.chunk.tokens", 0)) for c in chunks)
    )
    return out


def mean_stages(rows: Sequence[dict[str, float]]) -> dict[str, float] | None:
    """Each stage's mean over requests (None for none)."""
    if not rows:
        return None
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def fetch_window(jaeger_url: str, start_s: float, end_s: float) -> list[list[Span]]:
    """The whole traces whose gateway span started in ``[start_s, end_s]`` (unix seconds)."""
    base = jaeger_url.rstrip("/")
    query = urllib.parse.urlencode(
        {
            "service": GATEWAY_SERVICE,
            "start": int(start_s * 1e6),
            "end": int(end_s * 1e6),
            "limit": 10_000,
        }
    )
    found = _get(f"{base}/api/traces?{query}").get("data") or []
    out = []
    for t in found:  # the search may answer with only the spans that matched
        full = _get(f"{base}/api/traces/{t['traceID']}").get("data") or [t]
        spans = parse_jaeger(full[0])
        root = next((s for s in spans if s.parent_id is None), None)
        if root is not None and start_s * 1e6 <= root.start_us <= end_s * 1e6:
            out.append(spans)
    return out


def window_stages(
    jaeger_url: str, start_s: float, end_s: float, settle_s: float = 2.0
) -> list[dict[str, float]]:
    """``stages`` of every whole PD request of the window, once the components' batched
    exports (every 0.5 s) had time to arrive."""
    time.sleep(max(0.0, settle_s - (time.time() - end_s)))
    return [r for spans in fetch_window(jaeger_url, start_s, end_s) if (r := stages(spans))]
