"""Typed model configs built from a checkpoint's ``config.json``.

One parser per architecture; both accept DeepSeek's shipped keys (``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``) and transformers' spellings
(``layer_types``, ``mlp_layer_types``, ``partial_rotary_factor``, ``rope_parameters``).
Pure Python: importing this module never loads torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_serving.layers.quant.scheme import NONE, QuantScheme, scheme_from_config

_LAYER_TYPE_TO_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": -1,  # resolved to the CSA rate
    "heavily_compressed_attention": -2,  # resolved to the HCA rate
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of one kind ("default" or "yarn"), over ``dim`` channels."""

    theta: float
    dim: int
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # cos/sin multiplier; DeepSeek V4 pins it to 1.0 on its YaRN layers
    attention_factor: float = 1.0


def _yarn_from(d: dict[str, Any], theta: float, dim: int, force_factor_one: bool) -> RopeConfig:
    kind = str(d.get("rope_type", d.get("type", "default")))
    if kind not in ("default", "yarn"):
        raise ValueError(
            f"unsupported rope type {kind!r}: only 'default' and 'yarn' are implemented"
        )
    if kind == "default":
        return RopeConfig(theta=theta, dim=dim)
    factor = float(d["factor"])
    mscale = float(d.get("mscale") or 1.0)
    mscale_all = float(d.get("mscale_all_dim") or 0.0)
    if force_factor_one:
        att = 1.0
    elif d.get("attention_factor") is not None:
        att = float(d["attention_factor"])
    elif mscale and mscale_all:
        att = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    else:
        att = _yarn_mscale(factor, 1.0)
    return RopeConfig(
        theta=theta,
        dim=dim,
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        beta_fast=float(d.get("beta_fast") or 32),
        beta_slow=float(d.get("beta_slow") or 1),
        mscale=mscale,
        mscale_all_dim=mscale_all,
        attention_factor=att,
    )


def _yarn_mscale(scale: float, mscale: float) -> float:
    import math

    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class DeepseekV4Config:
    """DeepSeek V4: shared K=V head, window + CSA/HCA compressed attention, mHC, hash MoE."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    # per layer, 0 = window only, else the compression ratio (CSA or HCA rate); the entry at
    # index num_hidden_layers (if any) belongs to the MTP layer
    compress_ratios: tuple[int, ...]
    csa_ratio: int
    hca_ratio: int
    num_hash_layers: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    scoring_func: str
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    num_nextn_predict_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    architecture: str = "DeepseekV4ForCausalLM"
    # how the checkpoint's weights are stored (and kept): ``quantization_config``
    quant: QuantScheme = NONE
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.compress_ratios) < self.num_hidden_layers:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        for r in self.compress_ratios:
            if r not in (0, self.csa_ratio, self.hca_ratio):
                raise ValueError(f"compress ratio {r} is neither 0, CSA {self.csa_ratio} nor HCA")
        if self.csa_ratio == self.hca_ratio:
            raise ValueError("CSA and HCA ratios must differ")
        if self.num_attention_heads % self.o_groups:
            raise ValueError("num_attention_heads must be divisible by o_groups")
        if self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError("qk_rope_head_dim exceeds head_dim or index_head_dim")

    def layer_ratio(self, layer: int) -> int:
        """Compression ratio of ``layer`` (the MTP layer is ``num_hidden_layers``)."""
        if layer < len(self.compress_ratios):
            return self.compress_ratios[layer]
        return 0

    def is_csa(self, layer: int) -> bool:
        return self.layer_ratio(layer) == self.csa_ratio

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV4Config:
        n = int(d["num_hidden_layers"])
        rates = dict(d.get("compress_rates") or {})
        csa = int(d.get("compress_rate_csa", rates.get("compressed_sparse_attention", 4)))
        hca = int(d.get("compress_rate_hca", rates.get("heavily_compressed_attention", 128)))
        if d.get("compress_ratios") is not None:
            ratios = []
            for r in d["compress_ratios"]:
                r = int(r)
                # checkpoints write the canonical 4/128; a tiny config may shrink them
                ratios.append(csa if r == 4 else hca if r == 128 else r)
        elif d.get("layer_types") is not None:
            ratios = [{0: 0, -1: csa, -2: hca}[_LAYER_TYPE_TO_RATIO[t]] for t in d["layer_types"]]
        else:
            ratios = [hca] * min(n, 2) + [csa if i % 2 else hca for i in range(max(n - 2, 0))]
        if d.get("mlp_layer_types") is not None:
            n_hash = sum(1 for t in d["mlp_layer_types"] if t == "hash_moe")
        else:
            n_hash = int(d.get("num_hash_layers", 3))
        head_dim = int(d.get("head_dim", 512))
        if d.get("qk_rope_head_dim") is not None:
            rope_dim = int(d["qk_rope_head_dim"])
        elif d.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(d["partial_rotary_factor"]))
        else:
            rope_dim = 64
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = float(d.get("rope_theta", 10000.0))
        ctheta = float(d.get("compress_rope_theta", 160000.0))
        if isinstance(rp.get("main"), dict):
            main = _yarn_from(
                rp["main"], float(rp["main"].get("rope_theta", theta)), rope_dim, True
            )
            comp_d = rp["compress"]
            comp = _yarn_from(comp_d, float(comp_d.get("rope_theta", ctheta)), rope_dim, True)
        else:
            main = RopeConfig(theta=theta, dim=rope_dim)
            comp = _yarn_from(rp, ctheta, rope_dim, True)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(d["num_attention_heads"]),
            head_dim=head_dim,
            q_lora_rank=int(d["q_lora_rank"]),
            qk_rope_head_dim=rope_dim,
            o_groups=int(d.get("o_groups", 8)),
            o_lora_rank=int(d.get("o_lora_rank", 1024)),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            n_routed_experts=int(d["n_routed_experts"]),
            n_shared_experts=int(d.get("n_shared_experts", 1)),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            compress_ratios=tuple(ratios),
            csa_ratio=csa,
            hca_ratio=hca,
            num_hash_layers=n_hash,
            index_n_heads=int(d.get("index_n_heads", 64)),
            index_head_dim=int(d.get("index_head_dim", 128)),
            index_topk=int(d.get("index_topk", 512)),
            sliding_window=int(d.get("sliding_window", 128)),
            hc_mult=int(d.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            main_rope=main,
            compress_rope=comp,
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 0)),
            max_position_embeddings=int(d.get("max_position_embeddings", 1 << 20)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id", 0),
            eos_token_id=d.get("eos_token_id", 1),
            quant=scheme_from_config(d),
            raw=dict(d),
        )


@dataclass(frozen=True, slots=True)
class DeepseekV3Config:
    """DeepSeek V3: MLA latent cache, group-limited sigmoid MoE, dense first layers."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool
    num_nextn_predict_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    architecture: str = "DeepseekV3ForCausalLM"
    # how the checkpoint's weights are stored (and kept): ``quantization_config``
    quant: QuantScheme = NONE
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = _yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV3Config:
        rope_dim = int(d.get("qk_rope_head_dim", 64))
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
        q_lora = d.get("q_lora_rank", 1536)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(d.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(d.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(d.get("v_head_dim", 128)),
            n_routed_experts=int(d["n_routed_experts"]),
            n_shared_experts=int(d.get("n_shared_experts", 1)),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            first_k_dense_replace=int(d.get("first_k_dense_replace", 0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=_yarn_from(rp, theta, rope_dim, False),
            rope_interleave=bool(d.get("rope_interleave", True)),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 0)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id", 0),
            eos_token_id=d.get("eos_token_id", 1),
            quant=scheme_from_config(d),
            raw=dict(d),
        )


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {p}")
    data = json.loads(p.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{p} does not hold a JSON object")
    return data


def architecture_of(config: dict[str, Any]) -> str:
    """The ``architectures[0]`` a checkpoint declares; a clear error when absent."""
    archs = config.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ValueError("config.json has no 'architectures' list: cannot choose a model class")
    return str(archs[0])
