"""Imported KV onto every TP rank: the cache is replicated over TP (V4's single shared KV head,
compressor and indexer state; V3's latents), so what TP rank 0 (the core, the one rank that
talks to the sidecar) copied into its blocks and state slot, every follower copies from it.

Exports need nothing: every TP rank computes the same replicated cache, so rank 0 exports its
own. One broadcast per cache tensor, only in the steps where imports finished."""

from __future__ import annotations

from typing import Any

import torch

from dsv4_serving.distributed.comm import broadcast
from dsv4_serving.distributed.groups import Group


@torch.inference_mode()
def replicate_kv(cache: Any, loads: list[tuple[list[int], int]], tp: Group) -> None:
    """Every TP rank calls this with the same ``loads`` (block ids, state slot); afterwards
    its cache holds TP rank 0's rows there."""
    blocks = [b for ids, _ in loads for b in ids]
    slots = [slot for _, slot in loads]
    for rows, tensors in (
        (blocks, cache.named_paged_tensors()),
        (slots, cache.named_state_tensors()),
    ):
        if not rows:
            continue
        for _, _, t in tensors:
            idx = torch.tensor(rows, dtype=torch.long, device=t.device)
            part = t.index_select(0, idx)
            broadcast(part, tp, 0)
            if tp.index != 0:
                t.index_copy_(0, idx, part)
