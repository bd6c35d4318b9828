"""Packed token masks meet the logits: disallowed tokens become -inf."""

from __future__ import annotations

import torch

from dsv4_serving.structured.backend import bitmask_words


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` int32 on the CPU, all tokens allowed (a row no grammar fills stays so)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` bool: bit ``t % 32`` of word ``t // 32``; ids past the mask are False."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit is bit 31
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - width, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed entries of ``logits`` ``[rows, vocab]`` to -inf, in place; returns it."""
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} do not match"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"a bitmask is int32, not {bitmask.dtype}")
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    return logits.masked_fill_(~allowed, float("-inf"))
