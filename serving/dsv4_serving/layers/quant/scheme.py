"""Which quantization a checkpoint uses, from its ``config.json`` (and ModelSlim's description).

- DeepSeek's release: ``quantization_config = {quant_method: fp8, fmt: e4m3, weight_block_size:
  [128, 128]}``; V4 adds ``expert_dtype: fp4`` (top level or in the quantization config) for
  fp4 e2m1 routed experts.
- ModelSlim's W8A8 (what vllm-ascend serves DeepSeek with): ``quant_model_description.json``
  beside the weights, ``model_quant_type: W8A8_DYNAMIC``; or ``quant_method: w8a8`` in config.
Pure Python: importing this module never loads torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Quantization = Literal["none", "fp8", "fp4", "w8a8"]
LinearFormat = Literal["none", "fp8", "w8a8"]
ExpertFormat = Literal["none", "fp8", "fp4", "w8a8"]
DESCRIPTION_FILE = "quant_model_description.json"


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How the quantized linears and the routed experts hold their weights."""

    linear: LinearFormat = "none"
    experts: ExpertFormat = "none"
    block: tuple[int, int] = (128, 128)  # fp8 scale block (output rows, input columns)

    @property
    def name(self) -> Quantization:
        """``fp4`` names DeepSeek-V4 as shipped: fp8 linears with fp4 experts."""
        if self.experts == "fp4":
            return "fp4"
        return self.linear

    @classmethod
    def of(cls, name: Quantization, block: tuple[int, int] = (128, 128)) -> QuantScheme:
        if name == "fp4":
            return cls("fp8", "fp4", block)
        if name not in ("none", "fp8", "w8a8"):
            raise ValueError(f"unknown quantization {name!r} (none, fp8, fp4, w8a8)")
        return cls(name, name, block)


NONE = QuantScheme()


def scheme_from_config(d: dict[str, Any]) -> QuantScheme:
    """The scheme a ``config.json`` declares (``none`` without ``quantization_config``)."""
    qc = d.get("quantization_config")
    if not qc:
        return NONE
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        if str(qc.get("fmt", "e4m3")) != "e4m3":
            raise ValueError(f"fp8 format {qc.get('fmt')!r}: only e4m3 is supported")
        if str(qc.get("activation_scheme", "dynamic")) != "dynamic":
            raise ValueError("fp8 with static activation scales is not supported (dynamic only)")
        bs = qc.get("weight_block_size") or [128, 128]
        if len(bs) != 2 or min(int(b) for b in bs) < 1:
            raise ValueError(f"fp8 weight_block_size {bs!r}: expected two positive sizes")
        experts = str(qc.get("expert_dtype", d.get("expert_dtype", "fp8")))
        if experts not in ("fp8", "fp4"):
            raise ValueError(f"expert_dtype {experts!r}: fp8 or fp4")
        return QuantScheme("fp8", "fp4" if experts == "fp4" else "fp8", (int(bs[0]), int(bs[1])))
    if method in ("w8a8", "w8a8_dynamic"):
        return QuantScheme("w8a8", "w8a8")
    raise ValueError(
        f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported "
        "(fp8 block-scaled, fp4 experts, W8A8 dynamic)"
    )


def scheme_from_checkpoint(d: dict[str, Any], ckpt: Path | None) -> QuantScheme:
    """``config.json``'s scheme, or W8A8 when ModelSlim's description file says so."""
    if ckpt is not None and (ckpt / DESCRIPTION_FILE).is_file():
        desc = json.loads((ckpt / DESCRIPTION_FILE).read_text())
        kind = str(desc.get("model_quant_type", "")).upper()
        if kind != "W8A8_DYNAMIC":
            raise ValueError(
                f"{DESCRIPTION_FILE}: model_quant_type {kind!r} is not supported (W8A8_DYNAMIC: "
                "per-channel int8 weights, per-token dynamic int8 activations)"
            )
        return QuantScheme("w8a8", "w8a8")
    return scheme_from_config(d)
