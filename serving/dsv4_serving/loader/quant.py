"""The quantized formats' math: dequantisation to the compute dtype (the oracle, and the
``--quantization none`` load path) and quantisation (tests, dummy weights, tools).

- fp8 e4m3 weights with (bn x bk) block scales, 128x128 as DeepSeek ships: ``weight_scale_inv``
  (float32, V3) or ``scale`` (e8m0, V4); ``w = fp8 * scale[i // bn, j // bk]``.
- fp4 e2m1 experts (V4), two values per int8 byte (element ``2j`` in the low nibble) with one
  e8m0 scale per block of input channels (32).
- W8A8 int8 (ModelSlim's W8A8_DYNAMIC weights): ``weight_scale`` per output channel ([O] or
  [O, 1]), ``weight_offset`` zero (symmetric); ``w = int8 * scale[i]``.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
Block = tuple[int, int]
# e2m1 code -> value; bit 3 is the sign
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (float8_e8m0fnu or raw uint8 exponents) -> float32 powers of two."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequant_fp8_block(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    block: Block = (FP8_BLOCK, FP8_BLOCK),
) -> torch.Tensor:
    out_f, in_f = weight.shape
    bn, bk = block
    s = e8m0_to_float(scale) if scale.dtype != torch.float32 else scale
    if s.shape != (-(-out_f // bn), -(-in_f // bk)):
        raise ValueError(
            f"fp8 scale shape {tuple(s.shape)} does not tile {tuple(weight.shape)} in "
            f"{bn}x{bk} blocks"
        )
    # one float copy, scaled a block row at a time (no full-size scale map beside it)
    out = weight.to(torch.float32)
    for b in range(s.shape[0]):
        out[b * bn : (b + 1) * bn].mul_(s[b].repeat_interleave(bk)[:in_f])
    return out.to(dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[O, I/2] int8 (or float4_e2m1fn_x2) -> [O, I] float32 e2m1 values."""
    b = packed.view(torch.uint8).int()
    lo, hi = b & 0xF, (b >> 4) & 0xF
    codes = torch.stack((lo, hi), dim=-1).flatten(-2)
    return E2M1.to(packed.device)[codes.long()]


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    vals = unpack_fp4(packed)
    s = e8m0_to_float(scale)
    block = vals.shape[1] // s.shape[1]
    return (vals * s.repeat_interleave(block, dim=1)).to(dtype)


def is_fp4(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """fp4 packs two values per byte and scales blocks of 32 along the input, so its scale
    has more columns per weight column than an fp8 128x128 block scale."""
    if weight.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return True
    return weight.dtype in (torch.int8, torch.uint8) and scale.shape[0] == weight.shape[0]


def int8_channel_scale(scale: torch.Tensor, offset: torch.Tensor | None, what: str) -> torch.Tensor:
    """ModelSlim's per-channel scale ([O] or [O, 1]) as float32 [O]; the offset must be zero
    (symmetric: W8A8_DYNAMIC as vllm-ascend serves DeepSeek)."""
    if offset is not None and bool(offset.ne(0).any()):
        raise ValueError(f"{what}: non-zero weight_offset (asymmetric int8) is not supported")
    return scale.float().reshape(scale.shape[0], -1)[:, 0] if scale.dim() > 1 else scale.float()


def dequant_int8_channel(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    out = weight.to(torch.float32)  # one float copy, scaled in place
    return out.mul_(scale.float().reshape(weight.shape[0], 1)).to(dtype)


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    block: Block = (FP8_BLOCK, FP8_BLOCK),
    int8_channel: bool = False,
) -> torch.Tensor:
    if int8_channel:
        return dequant_int8_channel(weight, scale, dtype)
    if is_fp4(weight, scale):
        return dequant_fp4(weight, scale, dtype)
    return dequant_fp8_block(weight, scale, dtype, block)


# -- the inverse, for writing tiny quantised checkpoints in tests and tools -----------------


def quantize_fp8_block(
    w: torch.Tensor, e8m0: bool, block: Block = (FP8_BLOCK, FP8_BLOCK)
) -> tuple[torch.Tensor, torch.Tensor]:
    out_f, in_f = w.shape
    bn, bk = block
    nb_o, nb_i = -(-out_f // bn), -(-in_f // bk)
    pad = torch.zeros(nb_o * bn, nb_i * bk)
    pad[:out_f, :in_f] = w.float()
    blocks = pad.view(nb_o, bn, nb_i, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    if e8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    full = scale.repeat_interleave(bn, 0)[:out_f].repeat_interleave(bk, 1)[:, :in_f]
    q = (w.float() / full).to(torch.float8_e4m3fn)
    if e8m0:
        return q, (torch.log2(scale) + 127).round().to(torch.uint8)
    return q, scale


def quantize_fp4(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    out_f, in_f = w.shape
    g = w.float().view(out_f, in_f // block, block)
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-12) / 6.0)))
    x = g / scale[..., None]
    codes = (x.flatten(1)[..., None] - E2M1[None, None, :]).abs().argmin(-1)
    codes = codes.view(out_f, in_f // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8).view(torch.int8)
    return packed, (torch.log2(scale) + 127).round().to(torch.uint8)


def quantize_int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (weight, float32 scale [O])."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale
