"""The gateway's one config object: ``dsv4 gateway``'s flags are built from its fields (name,
default and the docstring under each as help), and it is passed down from there (or a test)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dsv4_common.kv_events import parse_endpoint
from dsv4_common.tracing import check_endpoint
from dsv4_serving.gateway.policies import PolicyName
from dsv4_serving.gateway.scorers import DEFAULT_WEIGHTS, parse_weights


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    prefill_urls: list[str] = field(default_factory=list)
    """Static prefill engines (base URLs)."""
    decode_urls: list[str] = field(default_factory=list)
    """Static decode engines."""
    both_urls: list[str] = field(default_factory=list)
    """Static engines that do both (no disaggregation)."""
    discovery: Literal["static", "kubernetes"] = "static"
    """Where instances come from: the URL lists, or EndpointSlices watched in ``namespace``."""
    namespace: str = "default"
    """Kubernetes discovery: the namespace to watch ($POD_NAMESPACE if set)."""
    selector: str = ""
    """Label selector of the EndpointSlices (role from their ``serving.dsv4.io/role`` label)."""
    kubeconfig: str | None = None
    """Kubernetes discovery: kubeconfig file (default: in-cluster, then ~/.kube/config)."""
    routing_configmap: str | None = None
    """Kubernetes discovery: ConfigMap (in ``namespace``) whose ``routing.json`` lists the
    instances the autoscaler drains; they get no new requests (the operator sets it)."""
    endpoint_host: str | None = None
    """Tests only: connect to this host instead of every EndpointSlice address (kwok pods have
    no reachable IP; the engines playing them run on this machine, and slices refuse loopback)."""
    policy: PolicyName = "dplb"
    """How an instance is chosen (see docs/gateway.md)."""
    served_model_name: str | None = None
    """Model name for /v1/models when no engine answers; requests are not rewritten."""
    selective_pd_tokens: int = 0
    """Prompts with fewer uncached tokens than this go to a decode engine alone (0: never)."""
    block_size: int = 16
    """Tokens per prefix-cache block, as the engines use (for prefix affinity), until the
    engines' KV events name theirs."""
    scorers: str = DEFAULT_WEIGHTS
    """``dplb``'s weighted scorers, ``name=weight,...`` (docs/cluster-kv.md): ``load``,
    ``precise_prefix`` (engines' KV events), ``estimated_prefix`` (engines without events)."""
    kv_events: list[str] = field(default_factory=list)
    """``ENGINE_URL=tcp://HOST:PORT``: that engine's ``--kv-events-endpoint``; the precise
    prefix index subscribes to it (every DP rank's)."""
    kv_events_port: int = 0
    """Every engine publishes KV events on this port of its own host (0: only ``--kv-events``)."""
    prefix_pulls: Literal["on", "off"] = "on"
    """Attach a prefix pull (``kv_transfer_params.dsv4_prefix_pull``) when a sidecar's host
    tier holds more of the prompt than the chosen instance caches and pulling is cheaper
    than computing (docs/cluster-kv.md); needs the engines' KV events."""
    prefix_pull_rate: float = 1e9
    """Bytes per second a pull moves between sidecars (the pull-or-recompute rule's rate)."""
    prefix_pull_bytes_per_token: float = 10_000.0
    """KV bytes per prompt token until PD prefill answers tell the engines' (V4-Flash's is
    about 9.8 KB)."""
    prefill_seconds_per_token: float = 1e-4
    """What computing one prompt token costs an engine (the rule's other side)."""
    tokenizer: str | None = None
    """The model's tokenizer for exact prefix hashes: a preset, a checkpoint directory or its
    tokenizer.json; chats of a model in DeepSeek's format are then rendered as the engine renders
    them (default: UTF-8 bytes stand in for tokens)."""
    chat_format: Literal["auto", "jinja", "deepseek_v4", "deepseek_v32"] = "auto"
    """With --tokenizer: the engines' --chat-format (auto: by the checkpoint's config.json)."""
    default_thinking: Literal["on", "off"] = "on"
    """With --tokenizer: the engines' --default-thinking (the mode of a chat that sets none)."""
    api_key: str | None = None
    """If set, clients must send ``Authorization: Bearer <key>``."""
    max_inflight: int = 1024
    """Requests in flight beyond this get 429 with Retry-After."""
    connect_timeout_s: float = 3.0
    """Time to open a connection to an engine, per attempt."""
    prefill_timeout_s: float = 600.0
    """Whole prefill call (the prompt's forward), per attempt."""
    first_byte_timeout_s: float = 600.0
    """Decode: time to the response headers, per attempt."""
    stream_idle_timeout_s: float = 300.0
    """Decode: longest silence between two chunks of a streamed answer."""
    retries: int = 1
    """Extra attempts on another instance when prefill fails, or decode fails before its first byte."""
    health_interval_s: float = 2.0
    """Seconds between health checks (and load scrapes) of each instance."""
    eject_after_failures: int = 2
    """Consecutive failed health checks (or upstream errors) that take an instance out."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """uvicorn's log level."""
    shutdown_timeout: float = 30.0
    """After SIGTERM: /ready fails and in-flight relays get up to this many seconds to finish."""
    otlp_traces_endpoint: str | None = None
    """OpenTelemetry traces of each request to this OTLP/HTTP endpoint (e.g.
    http://127.0.0.1:4318; /v1/traces is added when no path is given); unset: tracing off."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.max_inflight < 1:
            raise ValueError("--max-inflight must be >= 1")
        if self.retries < 0:
            raise ValueError("--retries must be >= 0")
        if self.block_size < 1:
            raise ValueError("--block-size must be >= 1")
        if not 0 <= self.shutdown_timeout <= 3600:
            raise ValueError("--shutdown-timeout must be in [0, 3600]")
        check_endpoint(self.otlp_traces_endpoint)
        parse_weights(self.scorers)
        self.kv_event_endpoints()
        if not 0 <= self.kv_events_port < 65535:
            raise ValueError("--kv-events-port must be in 0..65534")
        # the rule's own checks, with the flags' names
        if self.prefix_pull_rate <= 0 or self.prefix_pull_bytes_per_token < 0:
            raise ValueError("--prefix-pull-rate must be > 0, --prefix-pull-bytes-per-token >= 0")
        if self.prefill_seconds_per_token < 0:
            raise ValueError("--prefill-seconds-per-token must be >= 0")
        if self.eject_after_failures < 1:
            raise ValueError("--eject-after-failures must be >= 1")
        for name in (
            "connect_timeout_s",
            "prefill_timeout_s",
            "first_byte_timeout_s",
            "stream_idle_timeout_s",
            "health_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.tokenizer:
            check_tokenizer(self.tokenizer)
        if self.discovery == "static" and not (
            self.both_urls or (self.prefill_urls and self.decode_urls)
        ):
            raise ValueError(
                "static discovery needs --prefill and --decode engine URLs (PD), or --engine URLs "
                "(engines that do both)"
            )
        for url in (*self.prefill_urls, *self.decode_urls, *self.both_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL must start with http:// or https://, got {url!r}")

    def kv_event_endpoints(self) -> dict[str, str]:
        """``--kv-events`` as {engine URL: events endpoint}; ValueError naming a bad entry."""
        out: dict[str, str] = {}
        for entry in self.kv_events:
            url, sep, endpoint = entry.partition("=")
            if not sep or not url.startswith(("http://", "https://")):
                raise ValueError(f"--kv-events takes ENGINE_URL=tcp://HOST:PORT, got {entry!r}")
            parse_endpoint(endpoint)
            out[url.rstrip("/")] = endpoint
        return out


def check_tokenizer(spec: str) -> None:
    from dsv4_serving.presets.configs import PRESETS

    path = Path(spec)
    if spec in PRESETS or path.is_file() or (path / "tokenizer.json").is_file():
        return
    raise ValueError(
        f"--tokenizer {spec}: not a preset ({', '.join(sorted(PRESETS))}), a tokenizer.json or "
        "a directory holding one"
    )
