"""transformers' implementation of the same config with our weights: the correctness oracle of
the model tests and the baseline of the benchmark. Imports transformers only when called."""

from __future__ import annotations

from typing import Any

from torch import nn

from dsv4_serving.loader.names import to_transformers_state_dict
from dsv4_serving.models.config import architecture_of


def transformers_config_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json dict as keyword arguments transformers' config classes accept."""
    arch = architecture_of(config)
    skip = (
        "architectures",
        "model_type",
        "rope_scaling",
        "torch_dtype",
        "scoring_func",
        "topk_method",
    )
    kw = {k: v for k, v in config.items() if k not in skip}
    if arch == "DeepseekV4ForCausalLM":
        kw["scoring_func"] = config.get("scoring_func", "sqrtsoftplus")
        n = config["num_hidden_layers"]
        if "compress_ratios" in kw:
            kw["compress_ratios"] = list(kw["compress_ratios"])[:n]
    rs = config.get("rope_scaling")
    if rs:
        rs = dict(rs)
        rs["rope_type"] = rs.pop("type", rs.get("rope_type", "default"))
        if rs["rope_type"] != "default":
            if arch == "DeepseekV3ForCausalLM":
                rs.setdefault("rope_theta", config.get("rope_theta", 10000.0))
            kw["rope_parameters"] = rs
    return kw


def transformers_reference(config: dict[str, Any], ours: nn.Module) -> Any:
    """transformers' model for ``config``, float32, eval, loaded with ``ours``'s weights."""
    import transformers

    arch = architecture_of(config)
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, arch)
    hf_cfg = cfg_cls(**transformers_config_kwargs(config))
    hf_cfg._attn_implementation = "eager"
    ref = model_cls(hf_cfg).float().eval()
    sd = to_transformers_state_dict(ours.state_dict(), arch)
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise AssertionError(f"weight mapping: missing {missing}, unexpected {unexpected}")
    return ref
