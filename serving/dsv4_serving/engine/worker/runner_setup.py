"""Everything a rank needs to run steps: the model shard, the sizes derived from the config
(MTP drafts, state slots, KV blocks) and the runner over its cache.

The core (TP rank 0) and its TP followers build the same thing, so their caches have the same
shape: the block count is the minimum over the world, as each rank sizes its own memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsv4_serving.attention.mla import MLAttention
from dsv4_serving.distributed.comm import all_gather_object
from dsv4_serving.distributed.groups import SINGLE, SOLO, Group, ModelParallel
from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.engine.worker.model_loader import LoadedModel, load_model, num_kv_blocks
from dsv4_serving.engine.worker.model_runner import ModelRunner
from dsv4_serving.engine.worker.step_graphs import (
    Capture,
    Lane,
    StepGraphs,
    capture_for,
    num_lanes,
    padding_buckets,
)
from dsv4_serving.kernels.build import available

if TYPE_CHECKING:
    from dsv4_serving.eplb.balancer import Balancer


@dataclass(frozen=True, slots=True)
class RunnerSetup:
    lm: LoadedModel
    runner: ModelRunner
    num_speculative_tokens: int
    num_blocks: int
    has_state: bool  # per-sequence state slots (V4's window ring and compressor state)
    num_snapshots: int  # spare slots for prefix-cache state snapshots


def setup_runner(
    config: EngineConfig,
    parallel: ModelParallel = SINGLE,
    world: Group = SOLO,
    device_index: int = 0,
    reserve_dummy: bool = False,
) -> RunnerSetup:
    """``reserve_dummy``: one block and one state slot more than the scheduler gets, for the
    dummy batch an idle DP rank runs."""
    capture = _step_capture(config)  # a graph platform without its device: fail before loading
    lm = load_model(config, parallel, device_index)
    if lm.device.type == "cpu" and any(isinstance(m, MLAttention) for m in lm.model.modules()):
        # build (or load) the paged attention kernel now, not inside the first request
        available("paged_mla")
    if lm.device.type == "cpu":
        # likewise the quantized products' kernels (a g++ -O3 build on a cold cache)
        scheme = lm.model_config.quant
        for kernel in ("w8a8", "fp8"):
            if kernel in (scheme.linear, scheme.experts):
                available(kernel)
        if getattr(lm.model_config, "hc_mult", 0):
            available("mhc")  # V4's hyper-connections chain
    k = config.num_speculative_tokens
    if k < 0:
        k = 1 if lm.num_mtp_layers else 0
    if k and not lm.num_mtp_layers:
        raise ConfigError("num_speculative_tokens > 0 needs a model with an MTP layer")
    has_state = bool(lm.model.cache_class.bytes_per_slot(lm.model_config, 1))
    snaps = 0
    if config.enable_prefix_caching:
        snaps = config.num_prefix_state_snapshots or 2 * config.max_num_seqs
    num_slots = config.max_num_seqs + (snaps if has_state else 0)
    buckets = padding_buckets(config.max_num_seqs)
    n_lanes = num_lanes(buckets) if capture is not None else 0
    # the pads' state slots come out of the KV budget as the scheduler's do
    n_blocks = num_kv_blocks(config, lm, num_slots + n_lanes, k)
    n_blocks = min(all_gather_object(n_blocks, world))
    per_req = -(-(lm.max_model_len + k) // lm.block_size)
    if n_blocks < per_req:
        raise ConfigError(
            f"{n_blocks} KV blocks of {lm.block_size} tokens cannot hold one request of "
            f"max_model_len {lm.max_model_len}; lower max_model_len or add blocks"
        )
    extra = 1 if reserve_dummy else 0
    dummy = (n_blocks, num_slots) if reserve_dummy else None
    # the pads' scratch blocks and slots, past the scheduler's and the dummy's
    lanes = [Lane(n_blocks + extra + j, num_slots + extra + j) for j in range(n_lanes)]
    runner = ModelRunner(
        lm,
        n_blocks + extra + len(lanes),
        num_slots + extra + len(lanes),
        k,
        config.seed,
        parallel.step,  # the ranks of the step: its first samples
        dummy,
        _eplb(config, parallel, lm),
    )
    if parallel.cp.size > 1:
        from dsv4_serving.engine.worker.cp_runner import CPForward

        runner.forward = runner.model = CPForward(lm.model, parallel.cp, lm.block_size)
    if capture is not None:
        runner.graphs = StepGraphs(runner.forward, buckets, lanes, 1 + k, lm.block_size, capture)
    if config.emulate_step_time is not None:
        from dsv4_serving.engine.emulated.runner import EmulatedRunner
        from dsv4_serving.engine.emulated.step_time import StepTime

        runner = EmulatedRunner(runner, StepTime.parse(config.emulate_step_time))  # type: ignore[assignment]
    return RunnerSetup(lm, runner, k, n_blocks, has_state, snaps)


def _step_capture(config: EngineConfig) -> Capture | None:
    """The seam's capture (``--step-graphs``), checked against this engine's device."""
    if config.step_graphs == "off":
        return None
    from dsv4_serving.platform.device import detect_platform

    device = detect_platform(None if config.device == "auto" else config.device)
    return capture_for(config.step_graphs, device.name)


def _eplb(config: EngineConfig, parallel: ModelParallel, lm: LoadedModel) -> Balancer | None:
    """The expert balancer of a rank whose model was built with EPLB's slots."""
    if not parallel.eplb:
        return None
    from dsv4_serving.distributed.parallel_state import get_topology
    from dsv4_serving.eplb.balancer import Balancer

    return Balancer.for_model(
        lm.model,
        parallel,
        config.eplb_interval,
        config.eplb_window,
        groups=int(getattr(lm.model_config, "n_group", 1) or 1),
        nodes=get_topology().nnodes,
    )
