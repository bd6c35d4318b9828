"""The model's KV cache as the sidecar's named buffers, and the copies in and out of it.

A request's KV is, per cache group: the rows of its first ``n`` paged blocks (V4 compressed
entries per ratio and indexer keys of every layer incl. MTP; V3 latents) and its state slot
(V4 window ring, compressor and indexer-compressor state; nothing for V3). Each becomes one
buffer named after the tensor (``layers.3.comp``), shaped ``[n, *block_shape]`` or
``slot_shape``. An import checks that every buffer has exactly the name, dtype and shape this
engine would export: block size and ring lengths (MTP lookahead) are in the shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dsv4_kvtransfer.buffers import BufferSpec
from dsv4_kvtransfer.client import PlacedView, SidecarClient
from dsv4_kvtransfer.integrity import ParallelLayout
from dsv4_serving.engine.kv_connector.compat import KVIncompatible


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KVLayout:
    def __init__(self, cache: Any) -> None:
        self.paged: list[tuple[str, str, torch.Tensor]] = cache.named_paged_tensors()
        self.state: list[tuple[str, str, torch.Tensor]] = cache.named_state_tensors()
        self.block_size = int(cache.block_size)
        # the slice of the KV an export holds: the whole cache. V4's and V3's KV is replicated
        # over TP (one shared KV head; TP rank 0 exports, imports are copied to the others)
        # and every CP rank writes the same cache
        self.parallel = ParallelLayout()

    def rows(self) -> list[tuple[str, str, str, tuple[int, ...]]]:
        """``(name, group, dtype, one block's or slot's shape)`` per cache tensor."""
        return [
            (name, group, dtype_name(t.dtype), tuple(t.shape[1:]))
            for name, group, t in (*self.paged, *self.state)
        ]

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def specs(self, n_blocks: int) -> list[BufferSpec]:
        out = [
            BufferSpec(name, dtype_name(t.dtype), (n_blocks, *t.shape[1:]), group)
            for name, group, t in self.paged
        ]
        out += [
            BufferSpec(name, dtype_name(t.dtype), tuple(t.shape[1:]), group)
            for name, group, t in self.state
        ]
        return out

    def cache_groups(self, n_blocks: int) -> dict[str, int]:
        """Blocks per paged group, rows (slots) per state group."""
        groups = {group: n_blocks for _, group, _ in self.paged}
        groups.update({group: 1 for _, group, _ in self.state})
        return groups

    @staticmethod
    def _tensor(client: SidecarClient, placed: PlacedView) -> torch.Tensor:
        dt = getattr(torch, placed.spec.dtype)
        return torch.frombuffer(client.view(placed), dtype=dt).view(placed.spec.shape)

    @torch.inference_mode()
    def export(
        self,
        client: SidecarClient,
        buffers: Mapping[str, PlacedView],
        block_ids: list[int],
        slot: int,
    ) -> None:
        """Copy the blocks and the slot into the reserved staging buffers."""
        for name, _, t in self.paged:
            dst = self._tensor(client, buffers[name])
            idx = torch.tensor(block_ids, dtype=torch.long, device=t.device)
            if t.device.type == "cpu":
                torch.index_select(t, 0, idx, out=dst)
            else:
                dst.copy_(t.index_select(0, idx))
        for name, _, t in self.state:
            self._tensor(client, buffers[name]).copy_(t[slot])

    def check(self, buffers: Mapping[str, PlacedView], n_blocks: int) -> None:
        """``KVIncompatible`` unless the pulled buffers are exactly what this engine exports."""
        want = {s.name: s for s in self.specs(n_blocks)}
        got = {name: p.spec for name, p in buffers.items()}
        if set(want) != set(got):
            extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
            raise KVIncompatible(
                f"the prefill engine's KV has other cache tensors than this engine's "
                f"(unexpected {extra[:3]}, missing {missing[:3]}): a different model?"
            )
        for name, w in want.items():
            g = got[name]
            if (g.dtype, tuple(g.shape)) != (w.dtype, tuple(w.shape)):
                raise KVIncompatible(
                    f"KV buffer {name}: the prefill engine sent {g.dtype}{list(g.shape)}, this "
                    f"engine expects {w.dtype}{list(w.shape)} (same model, --dtype, --block-size "
                    "and --num-speculative-tokens on both sides?)"
                )

    @torch.inference_mode()
    def load(
        self,
        client: SidecarClient,
        buffers: Mapping[str, PlacedView],
        block_ids: list[int],
        slot: int,
        first: int = 0,
    ) -> int:
        """Copy pulled buffers into the blocks and the slot; -> bytes copied. ``first``: the
        pulled blocks before it are skipped (the cache holds them already)."""
        n = 0
        for name, _, t in self.paged:
            src = self._tensor(client, buffers[name])[first : first + len(block_ids)]
            idx = torch.tensor(block_ids, dtype=torch.long, device=t.device)
            t.index_copy_(0, idx, src.to(t.device))
            n += src.numel() * src.element_size()
        for name, _, t in self.state:
            src = self._tensor(client, buffers[name])
            t[slot].copy_(src)
            n += src.numel() * src.element_size()
        return n
