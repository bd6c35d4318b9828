"""The engine's one config object, built at the edge (CLI, engine.json, tests) and passed down.
Pure Python: validating it never loads torch."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from dsv4_common.tracing import TracingConfigError, check_endpoint
from dsv4_serving.distributed.topology import Topology, TopologyError

Role = Literal["both", "prefill", "decode"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
LoadFormat = Literal["auto", "safetensors", "dummy"]
Quantization = Literal["auto", "none", "fp8", "fp4", "w8a8"]
KVFailurePolicy = Literal["fail", "recompute"]
ChatFormatName = Literal["auto", "jinja", "deepseek_v4", "deepseek_v32"]
OnOff = Literal["on", "off"]


class ConfigError(ValueError):
    pass


@dataclass(slots=True)
class EngineConfig:
    """Every engine setting, declared once: ``dsv4 engine``'s flags and ``--config`` file keys
    are these fields; ``__post_init__`` is the one place they are validated."""

    model: str = "dsv4-tiny"
    """Checkpoint directory or preset name (presets load dummy weights unless told otherwise)."""
    served_model_name: str | None = None
    """The name clients use in ``model``; defaults to ``model``."""
    revision: str | None = None
    """The revision this engine runs as, part of the KV layout fingerprint every export
    carries: an engine uses pulled KV only from an engine of the same revision (else it
    recomputes the prompt). The operator passes its deployment revision (a hash of model,
    image and engine flags, ``serving.dsv4.io/revision``); None = a hash of the model's config."""
    role: Role = "both"
    """Prefill/decode disaggregation role: ``prefill`` computes prompts for remote decodes,
    ``decode`` continues from KV pulled from a prefill engine, ``both`` serves whole requests
    (and PD requests of either kind when it has a sidecar)."""
    kv_sidecar: str | None = None
    """The local ``dsv4 kv-sidecar``'s control API (http://127.0.0.1:14580); required for
    ``prefill`` and ``decode``."""
    kv_failure_policy: KVFailurePolicy = "recompute"
    """Decode, when a pull fails or times out: ``fail`` the request (HTTP 503 naming the
    reason) or ``recompute`` its prompt locally."""
    kv_pull_timeout: float = 30.0
    """Seconds a decode request waits for its KV before the failure policy applies."""
    kv_sidecar_wait: float = 10.0
    """Seconds to wait at start-up for the sidecar to answer before giving up."""
    device: str = "auto"
    """cpu | cuda | npu | auto."""
    dtype: DType = "auto"
    """Weights and KV dtype; auto = float32 on CPU, bfloat16 elsewhere."""
    load_format: LoadFormat = "auto"
    """auto = dummy for presets, safetensors for directories."""
    quantization: Quantization = "auto"
    """How weights are held: auto = as the checkpoint stores them (fp8 128x128 blocks, fp4
    experts, W8A8 int8 stay quantized); none = dequantized to ``dtype`` at load; fp8 / fp4
    (fp8 linears + fp4 experts, DeepSeek-V4 as shipped) / w8a8 must match the checkpoint."""
    seed: int = 0
    """Dummy-weight seed and the sampler's default seed."""
    block_size: int = 0
    """Tokens per KV block; 0 = the smallest multiple of the model's compression ratios >= 16."""
    num_kv_blocks: int = 0
    """Paged KV blocks; 0 = sized from ``kv_cache_memory_gb`` (CPU) or
    ``gpu_memory_utilization`` (accelerators)."""
    kv_cache_memory_gb: float = 1.0
    """CPU: memory for the paged KV pool when ``num_kv_blocks`` is 0."""
    gpu_memory_utilization: float = 0.9
    """Accelerators: fraction of device memory for weights + activations + KV."""
    max_model_len: int = 0
    """Prompt + output tokens per request; 0 = the model's max_position_embeddings."""
    max_num_seqs: int = 64
    """Requests running at once (also the number of per-sequence state slots)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decode tokens + draft tokens)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps, mixed with decode tokens."""
    prompt_deadline: float = 0.0
    """SLO-aware prompt order: a prompt's first token is due this many seconds after it reaches
    the engine (prefill role: its KV ready for the decode, so leave the transfer and the decode's
    first step room within the TTFT objective). The waiting prompts that can still make it go
    first, earliest deadline first, judged by this engine's measured seconds per token; those
    that cannot go after them in arrival order, still served (``engine/core/sched/prefill_order.py``).
    0 = first come, first served."""
    enable_prefix_caching: bool = True
    """Share full KV blocks of equal prefixes across requests."""
    num_prefix_state_snapshots: int = 0
    """V4: spare state slots holding snapshots at block boundaries (prefix caching of the window
    ring and compressor state); 0 = 2 * max_num_seqs."""
    num_speculative_tokens: int = -1
    """MTP draft tokens per step (0-3); -1 = 1 when the model has an MTP layer, else 0."""
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    """Schedule step N+1 (and take step N-1's outputs) while step N runs, the forward on its
    own thread; greedy tokens stay the synchronous engine's. auto = on where that is exact and
    done: everywhere but context parallelism; on = the same, an error there."""
    step_graphs: Literal["off", "eager", "cuda", "npu"] = "off"
    """The device-step seam for graphs (``engine/worker/step_graphs.py``): decode steps (every
    request adds its token and all its drafts, none prefilling) padded to the batch sizes a
    captured graph would have, each shape run by its own callable. off = unpadded, eager =
    padded, the callables eager (CPU: the pads' compute is extra work); cuda / npu = CUDA / ACL
    graphs, refused at start on an engine without that device (capture is not built yet)."""
    tensor_parallel_size: int = 1
    """Devices each layer is split across; one process per rank (CPU: ranks share the CPUs)."""
    data_parallel_size: int = 1
    """Replicas of the attention layers inside one engine."""
    expert_parallel_size: int = 1
    """Devices the MoE experts are spread over."""
    context_parallel_size: int = 1
    """Ranks a prefill chunk's tokens are split over (zig-zag, ``cp_plan.split_chunk``); each
    is a process like a TP rank and holds the whole (replicated) cache; decode steps run on
    every CP rank unsplit. V4 and V3 models; world = tp x cp x dp. Alias ``-cp``."""
    exact_moe: bool = False
    """Expert parallelism sums each (token, expert choice)'s row over the EP ranks and adds the
    k choices locally in the single-process order: EP outputs are bitwise those of one process
    (k times the combine traffic; tests and CPU)."""
    enable_eplb: bool = False
    """Expert-parallel load balancing (needs expert_parallel_size > 1): count each MoE
    layer's tokens per expert and every ``eplb_interval`` steps re-place the experts over the
    EP ranks (replicating the hottest into the redundant slots), moving one layer's weights
    per step while serving; with ``exact_moe`` outputs are bitwise those of EPLB off, else
    equal up to float rounding."""
    eplb_redundant_experts: int = 0
    """EPLB: physical expert slots per MoE layer beyond the routed experts, for replicas of hot
    experts (experts + redundant must split evenly over the EP ranks)."""
    eplb_interval: int = 600
    """EPLB: forward steps between re-placements (dummy steps of idle DP ranks count)."""
    eplb_window: int = 600
    """EPLB: the last this many forward steps' expert load decide a re-placement."""
    rank_table: str | None = None
    """HCCL rank table (Ascend multi-node)."""
    architecture: str | None = None
    """When set, the checkpoint's config.json must name this architecture (e.g.
    DeepseekV4ForCausalLM); the engine refuses to start on another model."""
    threads_per_rank: int = 0
    """Torch threads of each rank's process; 0 = torch's default with one rank, else this
    machine's CPUs split evenly over the ranks."""
    distributed_timeout: float = 60.0
    """Seconds a rank waits in a rendezvous or collective before it gives up (a dead peer)."""
    rendezvous_timeout: float = 0.0
    """Seconds the ranks wait for each other at start before naming the missing ones; 0 =
    distributed_timeout. The nodes of a multi-node instance may start minutes apart (an image
    pulled on one node only): the operator sets the role's startupTimeoutSeconds."""
    chat_format: ChatFormatName = "auto"
    """How /v1/chat/completions renders messages: ``auto`` by the checkpoint's config.json
    (DeepSeek's own encoder for ``deepseek_v4`` / ``deepseek_v32``, the tokenizer's Jinja
    ``chat_template`` otherwise), or that format by name."""
    default_thinking: OnOff = "on"
    """Thinking mode of a chat request that sets none of ``thinking``,
    ``chat_template_kwargs.thinking`` / ``enable_thinking`` or ``reasoning_effort: "none"``
    (DeepSeek's API defaults to thinking)."""
    otlp_traces_endpoint: str | None = None
    """OpenTelemetry traces of each request to this OTLP/HTTP endpoint (e.g.
    http://127.0.0.1:4318; /v1/traces is added when no path is given); unset: tracing off."""
    kv_events_endpoint: str | None = None
    """Publish KV cache events (vLLM's schema, msgpack over ZMQ PUB) on this ``tcp://HOST:PORT``;
    DP rank r publishes on PORT+2r and serves replay on PORT+2r+1 (docs/cluster-kv.md); unset:
    off."""
    shutdown_timeout: float = 30.0
    """Seconds in-flight requests get to finish after SIGTERM (readiness fails at once, new
    requests get 503 + X-DSV4-Draining); what is left then is stopped with an error."""
    emulate_step_time: str | None = None
    """EMULATED engine, for capacity tests only: ``"base_ms,per_seq_ms,per_token_ms"`` makes
    every step sleep ``base + per_seq x sequences + per_token x tokens`` ms instead of running
    the model, with synthetic deterministic tokens; scheduler, KV blocks, metrics and the PD
    protocol stay real (``engine/emulated/runner.py``). /metrics shows
    ``dsv4_engine_emulated_step_time``."""

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ConfigError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"unsupported dtype {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ConfigError(f"unsupported load_format {self.load_format!r}")
        if self.quantization not in ("auto", "none", "fp8", "fp4", "w8a8"):
            raise ConfigError(
                f"quantization must be auto, none, fp8, fp4 or w8a8, got {self.quantization!r}"
            )
        if self.chat_format not in ("auto", "jinja", "deepseek_v4", "deepseek_v32"):
            raise ConfigError(f"unknown chat_format {self.chat_format!r}")
        if self.default_thinking not in ("on", "off"):
            raise ConfigError(f"default_thinking must be on or off, got {self.default_thinking!r}")
        if self.block_size < 0 or self.num_kv_blocks < 0 or self.max_model_len < 0:
            raise ConfigError("block_size, num_kv_blocks and max_model_len must be >= 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 <= self.prompt_deadline <= 3600:
            raise ConfigError(
                f"prompt_deadline must be in [0, 3600] seconds (0: first come, first served), "
                f"got {self.prompt_deadline}"
            )
        if not -1 <= self.num_speculative_tokens <= 3:
            raise ConfigError(
                f"num_speculative_tokens must be 0-3 (or -1 for the default), "
                f"got {self.num_speculative_tokens}"
            )
        for name in (
            "tensor_parallel_size",
            "data_parallel_size",
            "expert_parallel_size",
            "context_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        self._check_eplb()
        self._check_async()
        self._check_step_graphs()
        self._check_cp()
        if self.threads_per_rank < 0 or self.distributed_timeout <= 0:
            raise ConfigError("threads_per_rank must be >= 0 and distributed_timeout > 0")
        if self.rendezvous_timeout < 0:
            raise ConfigError("rendezvous_timeout must be >= 0 (0: distributed_timeout)")
        try:
            check_endpoint(self.otlp_traces_endpoint)
        except TracingConfigError as exc:
            raise ConfigError(str(exc)) from None
        self.topology()
        self._check_kv_events()
        if self.role != "both" and not self.kv_sidecar:
            raise ConfigError(
                f"--role {self.role} needs --kv-sidecar URL: the control API of the local "
                "`dsv4 kv-sidecar` (e.g. http://127.0.0.1:14580)"
            )
        if self.kv_sidecar and not self.kv_sidecar.startswith(("http://", "unix:")):
            raise ConfigError(f"--kv-sidecar must be an http:// URL, got {self.kv_sidecar!r}")
        if self.kv_failure_policy not in ("fail", "recompute"):
            raise ConfigError(
                f"kv_failure_policy must be fail or recompute, got {self.kv_failure_policy!r}"
            )
        if not 0 < self.kv_pull_timeout <= 3600:
            raise ConfigError(f"kv_pull_timeout must be in (0, 3600], got {self.kv_pull_timeout}")
        if self.kv_sidecar_wait < 0:
            raise ConfigError("kv_sidecar_wait must be >= 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if not 0 <= self.shutdown_timeout <= 3600:
            raise ConfigError(f"shutdown_timeout must be in [0, 3600], got {self.shutdown_timeout}")
        if self.emulate_step_time is not None:
            from dsv4_serving.engine.emulated.step_time import StepTime, StepTimeError

            try:
                StepTime.parse(self.emulate_step_time)
            except StepTimeError as exc:
                raise ConfigError(str(exc)) from None

    def _check_async(self) -> None:
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError(
                f"async_scheduling must be auto, on or off, got {self.async_scheduling!r}"
            )
        if self.async_scheduling == "on" and self.async_unsupported():
            raise ConfigError(f"--async-scheduling on: {self.async_unsupported()}")

    def _check_step_graphs(self) -> None:
        if self.step_graphs not in ("off", "eager", "cuda", "npu"):
            raise ConfigError(
                f"step_graphs must be off, eager, cuda or npu, got {self.step_graphs!r}"
            )
        # the emulated runner runs no forward; CP's decode with pads is not checked exact
        if self.step_graphs != "off" and self.emulate_step_time is not None:
            raise ConfigError("--step-graphs and --emulate-step-time cannot be combined")
        if self.step_graphs != "off" and self.context_parallel_size > 1:
            raise ConfigError("--step-graphs with --context-parallel-size > 1 is not supported yet")

    def async_unsupported(self) -> str | None:
        """Why async scheduling is not exact here (None: it is)."""
        cp_with = self.num_speculative_tokens != 0 or self.data_parallel_size > 1
        if self.context_parallel_size > 1 and cp_with:
            # each of CP+MTP, CP+DP and async+MTP/DP is tested exact; not the three together
            return (
                "context parallelism with MTP drafts or DP is not yet checked exact with async "
                "scheduling (use --num-speculative-tokens 0 and --data-parallel-size 1)"
            )
        return None

    def _check_eplb(self) -> None:
        if not self.enable_eplb:
            if self.eplb_redundant_experts:
                raise ConfigError("--eplb-redundant-experts needs --enable-eplb")
            return
        if self.emulate_step_time is not None:
            # the emulated runner computes no experts: there would be no load to balance
            raise ConfigError("--enable-eplb and --emulate-step-time cannot be combined")
        if self.expert_parallel_size < 2:
            raise ConfigError(
                "--enable-eplb needs --expert-parallel-size > 1: EPLB balances experts over "
                f"EP ranks, and there are {self.expert_parallel_size}"
            )
        if self.eplb_redundant_experts < 0:
            raise ConfigError(
                f"--eplb-redundant-experts must be >= 0, got {self.eplb_redundant_experts}"
            )
        if self.eplb_interval < 1 or self.eplb_window < 1:
            raise ConfigError(
                f"--eplb-interval and --eplb-window must be >= 1 step, got "
                f"{self.eplb_interval} and {self.eplb_window}"
            )

    def _check_cp(self) -> None:
        """Context parallel: what it does not support yet is refused, naming the flag."""
        if self.context_parallel_size == 1:
            return
        flag = f"--context-parallel-size {self.context_parallel_size}"
        refused = [
            (self.emulate_step_time is not None, "--emulate-step-time"),
            (self.role == "decode", "--role decode (decode runs without CP)"),
        ]
        for bad, what in refused:
            if bad:
                raise ConfigError(f"{flag} cannot be combined with {what} yet")

    def _check_kv_events(self) -> None:
        if self.kv_events_endpoint is None:
            return
        from dsv4_common.kv_events import parse_endpoint

        try:
            parse_endpoint(self.kv_events_endpoint)
        except ValueError as exc:
            raise ConfigError(f"--kv-events-endpoint: {exc}") from None
        if not self.enable_prefix_caching:
            raise ConfigError("--kv-events-endpoint needs prefix caching (it reports the cache)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def topology(self, nnodes: int = 1) -> Topology:
        """The rank layout of these sizes (``ep`` must be 1 or ``tp x dp``)."""
        try:
            return Topology(
                self.tensor_parallel_size,
                self.data_parallel_size,
                self.expert_parallel_size,
                nnodes,
                self.context_parallel_size,
            )
        except TopologyError as exc:
            raise ConfigError(str(exc)) from None

    def check_parallel(self, device: str, model_config: Any = None) -> None:
        """The sizes form a valid topology that splits ``model_config`` evenly, on a setup
        the worker processes support."""
        topo = self.topology()
        if model_config is not None:
            try:
                topo.check_model(model_config)
            except TopologyError as exc:
                raise ConfigError(str(exc)) from None
            experts = getattr(model_config, "n_routed_experts", 0)
            slots = experts + self.eplb_redundant_experts
            if self.enable_eplb and slots % self.expert_parallel_size:
                raise ConfigError(
                    f"--eplb-redundant-experts {self.eplb_redundant_experts}: {experts} experts "
                    f"+ {self.eplb_redundant_experts} redundant = {slots} slots per MoE layer do "
                    f"not split evenly over --expert-parallel-size {self.expert_parallel_size}"
                )

    def rank_threads(self, cpus: int, local_ranks: int | None = None) -> int:
        """Torch threads of one rank's process on a machine with ``cpus`` CPUs shared by
        ``local_ranks`` ranks (default: the whole world; a node of a multi-node instance holds
        its share of it); 0 = leave torch's default, the single-process path."""
        world = self.topology().world
        if self.threads_per_rank:
            return self.threads_per_rank
        return 0 if world == 1 else max(1, cpus // (local_ranks or world))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown engine config keys: {', '.join(sorted(unknown))}")
        return cls(**d)
