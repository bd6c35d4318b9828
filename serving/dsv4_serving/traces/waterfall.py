"""One request's trace as a text waterfall (``dsv4 trace``). Pure: Jaeger's JSON trace in, text
out.

    +0.0 ms  412.3 ms |##########################| dsv4-gateway  text_completion m
    +0.4 ms   98.1 ms |######                    |   dsv4-gateway  dsv4.gateway.prefill  ...

Spans are listed depth first (children by start time) and indented by depth; the bar shows
where in the request each one ran."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# the attributes worth a column, per span name prefix (all others stay in the backend)
SHOWN = (
    "dsv4.request_id",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.response.finish_reasons",
    "dsv4.gateway.policy",
    "dsv4.gateway.attempt",
    "server.address",
    "dsv4.dp_rank",
    "http.response.status_code",
    "dsv4.prefix_cache.hit_tokens",
    "dsv4.chunk.tokens",
    "dsv4.chunk.context_tokens",
    "dsv4.kv.bytes",
    "dsv4.kv.transport",
    "dsv4.kv.bandwidth_bytes_per_s",
    "dsv4.kv.freed",
    "dsv4.kv.failure",
    "dsv4.engine.decode_steps",
    "dsv4.mtp.draft_tokens",
    "dsv4.mtp.accepted_tokens",
)
SHORT = {
    "gen_ai.usage.input_tokens": "in",
    "gen_ai.usage.output_tokens": "out",
    "gen_ai.response.finish_reasons": "finish",
    "dsv4.gateway.policy": "policy",
    "dsv4.gateway.attempt": "attempt",
    "server.address": "to",
    "dsv4.dp_rank": "rank",
    "http.response.status_code": "status",
    "dsv4.prefix_cache.hit_tokens": "cached",
    "dsv4.chunk.tokens": "tokens",
    "dsv4.chunk.context_tokens": "context",
    "dsv4.kv.bytes": "bytes",
    "dsv4.kv.transport": "transport",
    "dsv4.kv.bandwidth_bytes_per_s": "bw",
    "dsv4.kv.freed": "freed",
    "dsv4.kv.failure": "failure",
    "dsv4.engine.decode_steps": "steps",
    "dsv4.mtp.draft_tokens": "drafts",
    "dsv4.mtp.accepted_tokens": "accepted",
    "dsv4.request_id": "request",
}


@dataclass(slots=True)
class Span:
    span_id: str
    parent_id: str | None
    service: str
    name: str
    start_us: int
    duration_us: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: bool = False

    @property
    def end_us(self) -> int:
        return self.start_us + self.duration_us


def _tag(v: Any) -> Any:
    """Jaeger keeps an array attribute as its JSON text: the list again."""
    if isinstance(v, str) and v.startswith("[") and v.endswith("]"):
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def parse_jaeger(trace: Mapping[str, Any]) -> list[Span]:
    """Jaeger's ``/api/traces`` JSON of one trace -> its spans."""
    procs = {k: v.get("serviceName", "?") for k, v in (trace.get("processes") or {}).items()}
    spans = []
    for s in trace.get("spans", []):
        parent = next(
            (r["spanID"] for r in s.get("references", []) if r.get("refType") == "CHILD_OF"),
            None,
        )
        attrs = {t["key"]: _tag(t.get("value")) for t in s.get("tags", [])}
        spans.append(
            Span(
                s["spanID"],
                parent,
                procs.get(s.get("processID", ""), "?"),
                s["operationName"],
                int(s["startTime"]),
                int(s["duration"]),
                attrs,
                error=attrs.get("otel.status_code") == "ERROR" or attrs.get("error") is True,
            )
        )
    return spans


def ordered(spans: list[Span]) -> list[tuple[int, Span]]:
    """(depth, span) depth first, children by start time; orphans (parent not in the trace)
    are roots."""
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[Span]] = {}
    for s in spans:
        key = s.parent_id if s.parent_id in ids else None
        children.setdefault(key, []).append(s)
    out: list[tuple[int, Span]] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: (s.start_us, -s.duration_us)):
            out.append((depth, s))
            walk(s.span_id, depth + 1)

    walk(None, 0)
    return out


def _value(v: Any) -> str:
    if isinstance(v, list):
        return ",".join(str(x) for x in v)
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _attr(key: str, v: Any) -> str:
    if key == "dsv4.kv.bandwidth_bytes_per_s":
        return f"bw={float(v) / 1e6:.1f}MB/s"
    if key == "dsv4.kv.bytes":
        return f"bytes={int(v)}"
    return f"{SHORT.get(key, key)}={_value(v)}"


def render(spans: list[Span], width: int = 32, title: str = "") -> str:
    """The waterfall: offset and duration (ms), a bar over the trace's whole extent, service,
    span name (indented by depth) and its key attributes."""
    if not spans:
        return "(no spans)\n"
    t0 = min(s.start_us for s in spans)
    t1 = max(s.end_us for s in spans)
    total = max(t1 - t0, 1)
    rows = ordered(spans)
    svc_w = max(len(s.service) for s in spans)
    name_w = max(2 * d + len(s.name) for d, s in rows)
    lines = []
    if title:
        lines.append(title)
    lines.append(f"{'start':>11} {'duration':>10}  {'':{width + 2}}  {'service':<{svc_w}}  span")
    for depth, s in rows:
        a = int((s.start_us - t0) * width / total)
        b = max(a + 1, round((s.end_us - t0) * width / total))
        bar = " " * a + "#" * (min(b, width) - a) + " " * (width - min(b, width))
        attrs = " ".join(_attr(k, s.attributes[k]) for k in SHOWN if k in s.attributes)
        mark = " ERROR" if s.error else ""
        name = ("  " * depth + s.name).ljust(name_w)
        lines.append(
            f"{(s.start_us - t0) / 1e3:>+9.1f}ms {s.duration_us / 1e3:>8.1f}ms  |{bar}|  "
            f"{s.service:<{svc_w}}  {name}  {attrs}{mark}".rstrip()
        )
    return "\n".join(lines) + "\n"
