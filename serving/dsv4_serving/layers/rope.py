"""Rotary embeddings: inverse frequencies (default or YaRN) and their application.

DeepSeek rotates *interleaved* channel pairs ``(x0, x1), (x2, x3), ...``; V4 rotates the
trailing ``dim`` channels of each head, V3 the ``qk_rope_head_dim`` slice it splits off.
"""

from __future__ import annotations

import math

import torch

from dsv4_serving.models.config import RopeConfig


def inv_freq(rope: RopeConfig) -> torch.Tensor:
    """``[dim // 2]`` float32 inverse frequencies, computed on the CPU whatever the default
    device (a model built on the meta device for its parallel plan still gets real tables)."""
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.kind == "default":
        return extrapolation
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # type: ignore[assignment]
    channel = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((channel - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


class Rotary:
    """cos/sin tables for one rope kind, computed per step from positions."""

    def __init__(self, rope: RopeConfig, device: torch.device | str = "cpu") -> None:
        self.inv_freq = inv_freq(rope).to(device)
        self.scale = rope.attention_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, dim // 2]`` each, float32."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos() * self.scale, freqs.sin() * self.scale


_SWAP_SIGN: dict[tuple[torch.device, bool], torch.Tensor] = {}


def rotate_tail_interleaved(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` [T, ..., D] in pairs.

    ``cos``/``sin`` are [T, half]; middle dims of ``x`` broadcast. ``inverse`` rotates by the
    negative angle (V4 undoes the rotation on its attention output).

    Computed as ``pair * cos + swapped_pair * (-sin, sin)``: the same products and sums as
    ``(x1 c - x2 s, x2 c + x1 s)`` bit for bit (negation is exact), in 6 ops instead of 9.
    """
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half, 1)
    c = cos.reshape(shape)
    key = (x.device, inverse)
    sign = _SWAP_SIGN.get(key)
    if sign is None:  # (x1, x2) -> (x2, x1) then times (-s, s): ``inverse`` negates s
        sign = _SWAP_SIGN[key] = torch.tensor([1.0, -1.0] if inverse else [-1.0, 1.0]).to(x.device)
    s = sin.reshape(shape) * sign
    nope = x[..., : -2 * half]
    pairs = x[..., -2 * half :].float().unflatten(-1, (half, 2))
    out = (pairs * c + pairs.flip(-1) * s).flatten(-2)
    return torch.cat((nope, out.to(x.dtype)), dim=-1)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, ..., 2 * half] pairing channel ``i`` with ``i + half`` (non-interleaved
    layout, V3's ``rope_interleave=False``)."""
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
