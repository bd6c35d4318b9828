"""Checkpoint tensor names -> our parameter names.

Our models use DeepSeek's native names with routed experts stacked (``ffn.experts.w1`` is
``[E, I, D]``). A checkpoint may use the native names (per-expert ``ffn.experts.E.w1.weight``)
or transformers' (``model.layers.N.self_attn.q_a_proj.weight``, stacked ``gate_up_proj``);
``convert`` turns one checkpoint tensor into the pieces of our parameters it fills.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch


class Piece(NamedTuple):
    param: str  # our parameter name
    tensor: torch.Tensor
    expert: int | None = None  # row of a stacked expert parameter, or the whole tensor


# transformers' in-layer names -> native, V4 (longest/most specific first)
_V4_LAYER = (
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_proj", "attn.indexer.compressor.wkv"),
    ("self_attn.compressor.indexer.gate_proj", "attn.indexer.compressor.wgate"),
    ("self_attn.compressor.indexer.kv_norm", "attn.indexer.compressor.norm"),
    ("self_attn.compressor.indexer.q_b_proj", "attn.indexer.wq_b"),
    ("self_attn.compressor.indexer.scorer.weights_proj", "attn.indexer.weights_proj"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_proj", "attn.compressor.wkv"),
    ("self_attn.compressor.gate_proj", "attn.compressor.wgate"),
    ("self_attn.compressor.kv_norm", "attn.compressor.norm"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_proj", "attn.wq_a"),
    ("self_attn.q_b_proj", "attn.wq_b"),
    ("self_attn.q_a_norm", "attn.q_norm"),
    ("self_attn.kv_proj", "attn.wkv"),
    ("self_attn.kv_norm", "attn.kv_norm"),
    ("self_attn.o_a_proj", "attn.wo_a"),
    ("self_attn.o_b_proj", "attn.wo_b"),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.shared_experts.gate_proj", "ffn.shared_experts.w1"),
    ("mlp.shared_experts.up_proj", "ffn.shared_experts.w3"),
    ("mlp.shared_experts.down_proj", "ffn.shared_experts.w2"),
)
_V4_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "head.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}

# transformers' / DeepSeek's HF-hosted V3 names -> native
_V3_LAYER = (
    ("self_attn.q_a_proj", "attn.wq_a"),
    ("self_attn.q_a_layernorm", "attn.q_norm"),
    ("self_attn.q_b_proj", "attn.wq_b"),
    ("self_attn.q_proj", "attn.wq"),
    ("self_attn.kv_a_proj_with_mqa", "attn.wkv_a"),
    ("self_attn.kv_a_layernorm", "attn.kv_norm"),
    ("self_attn.kv_b_proj", "attn.wkv_b"),
    ("self_attn.o_proj", "attn.wo"),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.shared_experts.gate_proj", "ffn.shared_experts.w1"),
    ("mlp.shared_experts.up_proj", "ffn.shared_experts.w3"),
    ("mlp.shared_experts.down_proj", "ffn.shared_experts.w2"),
    ("mlp.gate_proj", "ffn.w1"),
    ("mlp.up_proj", "ffn.w3"),
    ("mlp.down_proj", "ffn.w2"),
    # MTP extras of the HF-hosted V3 checkpoint (layer index num_hidden_layers + k)
    ("shared_head.norm", "norm"),
    ("shared_head.head", "head"),
    ("embed_tokens", "embed"),
    ("eh_proj", "eh_proj"),
    ("enorm", "enorm"),
    ("hnorm", "hnorm"),
)
_V3_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "head.weight",
}
_EXPERT_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_NATIVE_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


_HF_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def expert_of(name: str) -> int | None:
    """The routed expert a per-expert checkpoint tensor (or its scale) belongs to, from its
    name alone: the loader skips other ranks' experts before reading them."""
    m = re.match(r"^.*\.ffn\.experts\.(\d+)\.", name) or _HF_EXPERT.match(name)
    return int(m.group(1)) if m else None


def _rename(rest: str, table: tuple[tuple[str, str], ...]) -> str | None:
    for hf, native in table:
        if rest == hf or rest.startswith(hf + "."):
            return native + rest[len(hf) :]
    return None


def convert(
    name: str, tensor: torch.Tensor, arch: str, num_hidden_layers: int
) -> list[Piece] | None:
    """Pieces of our parameters that checkpoint tensor ``name`` fills; None if unknown."""
    v4 = arch == "DeepseekV4ForCausalLM"
    m = _NATIVE_EXPERT.match(name)
    if m:  # native per-expert tensor
        return [Piece(f"{m.group(1)}.{m.group(3)}", tensor, int(m.group(2)))]
    top = (_V4_TOP if v4 else _V3_TOP).get(name)
    if top is not None:
        return [Piece(top, tensor)]
    m = _HF_LAYER.match(name)
    if m is None:
        return [Piece(name, tensor)]  # already native (or unknown: the caller checks)
    layer, rest = int(m.group(1)), m.group(2)
    prefix = f"layers.{layer}."
    if layer >= num_hidden_layers:  # HF-hosted checkpoints put MTP layers after the model
        prefix = f"mtp.{layer - num_hidden_layers}."
    if rest == "mlp.experts.gate_up_proj":  # transformers' stacked [E, 2I, D]
        w1, w3 = tensor.chunk(2, dim=1)
        return [Piece(prefix + "ffn.experts.w1", w1), Piece(prefix + "ffn.experts.w3", w3)]
    if rest == "mlp.experts.down_proj":
        return [Piece(prefix + "ffn.experts.w2", tensor)]
    em = re.match(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", rest)
    if em:
        part = _EXPERT_PARTS[em.group(2)]
        return [Piece(f"{prefix}ffn.experts.{part}", tensor, int(em.group(1)))]
    native = _rename(rest, _V4_LAYER if v4 else _V3_LAYER)
    if native is None:
        return None
    return [Piece(prefix + native, tensor)]


def to_transformers_state_dict(ours: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """Our state dict in transformers' names (main model only; transformers has no MTP)."""
    v4 = arch == "DeepseekV4ForCausalLM"
    top = {v: k for k, v in (_V4_TOP if v4 else _V3_TOP).items()}
    table = _V4_LAYER if v4 else _V3_LAYER
    out: dict[str, torch.Tensor] = {}
    for name, t in ours.items():
        if name.startswith("mtp."):
            continue
        if name in top:
            out[top[name]] = t
            continue
        m = re.match(r"^layers\.(\d+)\.(.+)$", name)
        if m is None:
            raise KeyError(f"no transformers name for {name}")
        pre, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest == "ffn.experts.w1":
            out[pre + "mlp.experts.gate_up_proj"] = torch.cat(
                (t, ours[name[: -len("w1")] + "w3"]), dim=1
            )
            continue
        if rest == "ffn.experts.w3":
            continue
        if rest == "ffn.experts.w2":
            out[pre + "mlp.experts.down_proj"] = t
            continue
        for hf, native in table:
            if rest == native or rest.startswith(native + "."):
                out[pre + hf + rest[len(native) :]] = t
                break
        else:
            raise KeyError(f"no transformers name for {name}")
    return out
