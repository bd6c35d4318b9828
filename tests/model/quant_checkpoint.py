"""Tiny quantized checkpoints written the way each format ships (tests and benchmarks).

- fp8: DeepSeek's layout, ``quantization_config = {quant_method: fp8, weight_block_size}``;
  V3-style float32 ``weight_scale_inv`` or V4-style e8m0 ``scale``.
- fp4: V4 as shipped: fp8 linears plus fp4 routed experts (``expert_dtype: fp4``), two e2m1
  per int8 with an e8m0 ``scale`` per 32 inputs.
- w8a8: ModelSlim's W8A8_DYNAMIC: int8 ``weight``, per-channel ``weight_scale`` [O, 1] and a
  zero ``weight_offset`` [O, 1], ``quant_model_description.json`` beside the weights.
Which tensors are quantized follows the releases: attention and MLP projections and the
routed experts; not the V4 compressor / indexer ``weights_proj`` (shipped bf16), norms,
routers, embeddings, head, mHC or the MTP input projections.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dsv4_serving.loader.quant import quantize_fp4, quantize_fp8_block, quantize_int8_channel

_LINEAR = re.compile(
    r"(attn\.(wq|wq_a|wq_b|wkv|wkv_a|wkv_b|wo|wo_a|wo_b|indexer\.wq_b)"
    r"|ffn\.(w1|w2|w3)|ffn\.shared_experts\.(w1|w2|w3))\.weight$"
)
_EXPERTS = re.compile(r"ffn\.experts\.(w1|w2|w3)$")


def quantized_checkpoint(
    state: dict[str, torch.Tensor], fmt: str, v4: bool, block: tuple[int, int] = (128, 128)
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by checkpoint name, config.json additions) for a float state dict in our
    native names (routed experts written per expert, as the releases do)."""
    out: dict[str, torch.Tensor] = {}
    desc: dict[str, str] = {}

    def linear(name: str, w: torch.Tensor, experts: bool) -> None:
        stem = name[: -len(".weight")]
        if fmt == "w8a8":
            q, s = quantize_int8_channel(w)
            out[name], out[stem + ".weight_scale"] = q, s[:, None].contiguous()
            out[stem + ".weight_offset"] = torch.zeros_like(s)[:, None].contiguous()
            desc[name] = "W8A8_DYNAMIC"
        elif fmt == "fp4" and experts:
            packed, s = quantize_fp4(w)
            out[name], out[stem + ".scale"] = packed, s
        else:
            q, s = quantize_fp8_block(w, e8m0=v4, block=block)
            out[name] = q
            out[stem + (".scale" if v4 else ".weight_scale_inv")] = s

    for name, t in state.items():
        if _EXPERTS.search(name):
            stem, part = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                linear(f"{stem}.{e}.{part}.weight", t[e].contiguous(), experts=True)
        elif _LINEAR.search(name):
            linear(name, t, experts=False)
        else:
            out[name] = t.contiguous()
            desc[name] = "FLOAT"
    if fmt == "w8a8":
        return out, {"__description__": {"model_quant_type": "W8A8_DYNAMIC", **desc}}
    qc: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    if v4:
        qc["scale_fmt"] = "ue8m0"
    if fmt == "fp4":
        qc["expert_dtype"] = "fp4"
    return out, {"quantization_config": qc}


def write_checkpoint(
    root: Path,
    config: dict[str, Any],
    state: dict[str, torch.Tensor],
    fmt: str,
    block: tuple[int, int] = (128, 128),
    shards: int = 2,
) -> Path:
    """A checkpoint directory (config.json, sharded safetensors + index) in ``fmt``
    (``none`` writes the float state as is)."""
    root.mkdir(parents=True, exist_ok=True)
    v4 = config["architectures"][0] == "DeepseekV4ForCausalLM"
    if fmt == "none":
        tensors, extra = {k: v.contiguous() for k, v in state.items()}, {}
    else:
        tensors, extra = quantized_checkpoint(state, fmt, v4, block)
    desc = extra.pop("__description__", None)
    if desc is not None:
        (root / "quant_model_description.json").write_text(json.dumps(desc))
    (root / "config.json").write_text(json.dumps({**config, **extra}))
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(root / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root
