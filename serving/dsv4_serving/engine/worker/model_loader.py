"""Build the model an engine config names: preset or checkpoint directory, device, dtype,
weights. Also sizes the KV cache (the seed's memory profiling step)."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4_serving.distributed.groups import SINGLE, ModelParallel
from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.layers.quant.scheme import NONE, QuantScheme, scheme_from_checkpoint
from dsv4_serving.models.config import architecture_of, read_config_json
from dsv4_serving.presets.configs import PRESETS, preset_config

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_config_dict(model: str) -> tuple[dict[str, Any], Path | None]:
    """(config.json contents, checkpoint directory or None for a preset)."""
    if model in PRESETS:
        return preset_config(model), None
    p = Path(model)
    if not p.exists():
        raise ConfigError(
            f"model {model!r} is neither a directory nor a preset ({', '.join(sorted(PRESETS))})"
        )
    return read_config_json(p), p if p.is_dir() else p.parent


@dataclass(slots=True)
class LoadedModel:
    model: Any  # nn.Module with forward / compute_logits / mtp_forward / allocate_cache
    hf_config: dict[str, Any]
    model_config: Any  # DeepseekV4Config | DeepseekV3Config
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    num_mtp_layers: int


def resolve_quantization(
    requested: str, found: QuantScheme, model: str, preset: bool
) -> QuantScheme:
    """The scheme to build: the checkpoint's (``auto``), none (dequantize at load), or the
    requested one, which must be the checkpoint's; a preset has no checkpoint to disagree
    with, so its dummy weights take any format."""
    if requested == "auto":
        return found
    if requested == "none":
        return NONE
    if preset:
        return QuantScheme.of(requested)  # type: ignore[arg-type]
    if requested != found.name:
        raise ConfigError(
            f"--quantization {requested}: the checkpoint {model} is {found.name} (linears "
            f"{found.linear}, experts {found.experts}); use auto, none (dequantize at load) "
            f"or {found.name}"
        )
    return found


def default_block_size(model_config: Any) -> int:
    ratios = [
        r
        for r in (getattr(model_config, "csa_ratio", 0), getattr(model_config, "hca_ratio", 0))
        if r
    ]
    lcm = math.lcm(*ratios) if ratios else 1
    return lcm * max(1, -(-16 // lcm))


def load_model(
    config: EngineConfig, parallel: ModelParallel = SINGLE, device_index: int = 0
) -> LoadedModel:
    """The model (this rank's shard of it under ``parallel``, on device ``device_index`` of
    an accelerator) with its weights."""
    from dsv4_serving.layers.quant.methods import QuantError, cast_model
    from dsv4_serving.loader.weights import load_weights
    from dsv4_serving.models.registry import REGISTRY
    from dsv4_serving.platform.device import detect_platform

    hf, ckpt = model_config_dict(config.model)
    platform = detect_platform(None if config.device == "auto" else config.device)
    arch = architecture_of(hf)
    if config.architecture is not None and arch != config.architecture:
        raise ConfigError(
            f"--architecture {config.architecture}: the checkpoint {config.model} is {arch}"
        )
    cls = REGISTRY.resolve(arch)
    try:
        found = scheme_from_checkpoint(hf, ckpt)
        mcfg = cls.config_class.from_dict(hf)
    except ValueError as exc:
        raise ConfigError(f"{config.model}: {exc}") from None
    scheme = resolve_quantization(config.quantization, found, config.model, ckpt is None)
    if platform.name == "npu" and {scheme.linear, scheme.experts} & {"fp8", "fp4"}:
        raise ConfigError(
            f"{config.model} is {scheme.name}: Ascend 910 has no fp8/fp4 compute; serve a W8A8 "
            "checkpoint (ModelSlim W8A8_DYNAMIC) or --quantization none (bf16, 2 bytes/param)"
        )
    mcfg = dataclasses.replace(mcfg, quant=scheme)
    config.check_parallel(platform.name, mcfg)
    dtype_name = config.dtype
    if dtype_name == "auto":
        dtype_name = "float32" if platform.name == "cpu" else "bfloat16"
    dtype = _DTYPES[dtype_name]
    device = platform.torch_device(device_index)
    try:
        with torch.device(device):
            model = cls(mcfg, parallel)
    except QuantError as exc:
        raise ConfigError(f"--quantization {scheme.name}: {exc}") from None
    model = cast_model(model, dtype).eval()
    fmt = config.load_format
    if fmt == "auto":
        fmt = "dummy" if ckpt is None else "safetensors"
    if fmt == "safetensors" and ckpt is None:
        raise ConfigError(f"preset {config.model!r} has no weights; use load_format=dummy")
    load_weights(model, ckpt or ".", arch, mcfg.num_hidden_layers, fmt, seed=config.seed)
    bs = config.block_size or default_block_size(mcfg)
    max_len = config.max_model_len or int(mcfg.max_position_embeddings)
    if max_len > mcfg.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings "
            f"{mcfg.max_position_embeddings}"
        )
    log.info(
        "model %s (%s) on %s, %s, weights %s, block size %d",
        config.model,
        arch,
        device,
        dtype,
        scheme.name,
        bs,
    )
    return LoadedModel(
        model, hf, mcfg, device, dtype, bs, max_len, int(mcfg.num_nextn_predict_layers)
    )


def num_kv_blocks(
    config: EngineConfig, lm: LoadedModel, num_slots: int, lookahead: int, profile: Any = None
) -> int:
    """Paged blocks that fit: the configured count, else the memory budget left after the
    weights, the per-sequence state slots and (on accelerators) a profiled forward."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    cache_cls = lm.model.cache_class
    item = torch.empty((), dtype=lm.dtype).element_size()
    per_block = cache_cls.bytes_per_block(lm.model_config, lm.block_size, item)
    per_slot = cache_cls.bytes_per_slot(lm.model_config, item, lookahead)
    if lm.device.type == "cpu":
        budget = int(config.kv_cache_memory_gb * 2**30) - num_slots * per_slot
    else:
        mod = getattr(torch, lm.device.type)
        if profile is not None:
            mod.reset_peak_memory_stats()
            profile()
        _, total = mod.mem_get_info()
        peak = mod.max_memory_allocated()
        budget = int(total * config.gpu_memory_utilization) - peak - num_slots * per_slot
    n = budget // max(per_block, 1)
    if n <= 0:
        raise ConfigError(
            f"no memory left for the KV cache ({budget / 2**20:.0f} MiB after weights and "
            f"{num_slots} state slots); raise kv_cache_memory_gb / gpu_memory_utilization"
        )
    return int(n)
