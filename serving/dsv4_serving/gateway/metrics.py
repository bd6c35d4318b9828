"""Gateway metrics: latency as the client sees it (vLLM's names), routing, retries, ejections."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class GatewayMetrics:
    def __init__(self) -> None:
        self._outcomes: dict[str, Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token, at the gateway",
            registry=r,
            buckets=_LATENCY,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between streamed chunks, at the gateway",
            registry=r,
            buckets=_LATENCY,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, at the gateway",
            registry=r,
            buckets=_LATENCY,
        )
        self.requests = Counter(
            "dsv4_gateway_requests", "Requests by outcome", ["status"], registry=r
        )
        self.routed = Counter(
            "dsv4_gateway_routed", "Upstream calls per instance", ["role", "instance"], registry=r
        )
        self.retries = Counter(
            "dsv4_gateway_retries", "Attempts repeated on another instance", ["stage"], registry=r
        )
        self.ejections = Counter(
            "dsv4_gateway_ejections", "Instances taken out after failures", ["instance"], registry=r
        )
        self.inflight = Gauge("dsv4_gateway_inflight_requests", "Requests in flight", registry=r)
        self.healthy = Gauge(
            "dsv4_gateway_healthy_instances", "Healthy instances", ["role"], registry=r
        )
        self.selective = Counter(
            "dsv4_gateway_selective_pd",
            "Requests sent to decode alone (short uncached prompt)",
            registry=r,
        )
        self.pd_pairs = Counter(
            "dsv4_gateway_pd_pairs",
            "Decode choices after a prefill, by the two instances' revisions (rollouts: the two "
            "are always equal)",
            ["prefill_revision", "decode_revision"],
            registry=r,
        )

        # precise prefix routing (docs/cluster-kv.md): what the gateway predicted an engine
        # would find cached, and (PD prefill answers, whose usage the gateway reads) what it did
        self.predicted_cached = Counter(
            "dsv4_gateway_predicted_cached_tokens",
            "Prompt tokens predicted cached at the chosen prefill (or both) instance",
            ["instance"],
            registry=r,
        )
        self.actual_cached = Counter(
            "dsv4_gateway_actual_cached_tokens",
            "Prompt tokens the prefill instance reported cached (usage.prompt_tokens_details)",
            ["instance"],
            registry=r,
        )
        self.cached_error = Histogram(
            "dsv4_gateway_cached_tokens_error",
            "|actual - predicted| cached prompt tokens per PD request",
            registry=r,
            buckets=(0, 16, 64, 128, 256, 512, 1024, 4096, 16384),
        )
        self.kv_resyncs = Counter(
            "dsv4_gateway_kv_events_resyncs",
            "Index resynchronisations from an engine rank's replay (rebuild, continue, lossy)",
            ["instance", "rank", "kind"],
            registry=r,
        )
        self.migrations = Counter(
            "dsv4_gateway_stream_migrations",
            "Streams whose upstream failed mid-stream, continued on another instance "
            "(outcome continued) or ended with an error event (outcome failed)",
            ["reason", "outcome"],
            registry=r,
        )
        self.prefix_pulls = Counter(
            "dsv4_gateway_prefix_pulls",
            "Prefix pulls decided at a prefill (or both) choice: attached, or declined (a host "
            "tier held more of the prompt, computing was cheaper); of the attached ones in PD, "
            "loaded (the prefill's cached tokens cover the pull) or computed",
            ["outcome"],
            registry=r,
        )

    def outcome(self, status: str) -> Any:
        """dsv4_gateway_requests{status}: the child looked up once (labels() costs per call)."""
        child = self._outcomes.get(status)
        if child is None:
            child = self._outcomes[status] = self.requests.labels(status)
        return child
