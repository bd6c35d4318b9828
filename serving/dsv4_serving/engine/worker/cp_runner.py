"""The model forward of a context-parallel rank: a step's prefill chunks split over the CP
group, the rest of the step unsplit.

Each step the runner calls ``CPForward`` instead of the model. When a prefill chunk of the
step is long enough to split (``cp_plan.split_chunk``: at least ``2 x cp`` blocks), the step
runs with a ``CPShare`` (``attention/cp.py``): this rank computes its rows, the cache inputs
are all-gathered per layer, and every CP rank writes the same (replicated) cache. Otherwise
(decode steps, short chunks) every CP rank runs the whole step as one process would: no
collective, the same cache. The result has the flat batch's rows; under CP only this rank's
are filled (the rest are zero). The rows that sample are each chunk's last, which the zig-zag
split gives to CP rank 0, the rank that samples (``ModelRunner.samples``).

MTP: ``CPForward`` is also the model the runner drafts with (``runner.model``): the MTP
layer's pass over a split step's rows is split the same way (``mtp_forward``), its block
gathering its cache inputs like any layer, so its cache is replicated too. The drafts and the
chained MTP calls read each chunk's last row, CP rank 0's: broadcast over the CP group, so
every CP rank chains the same calls on the same inputs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dsv4_serving.attention.cp import CPShare, CPStats
from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.distributed import comm
from dsv4_serving.distributed.cp_plan import split_chunk
from dsv4_serving.distributed.groups import Group


def splits(meta: AttentionMetadata, cp: int, align: int) -> bool:
    """Whether any chunk of the step is split over ``cp`` ranks."""
    qsl = meta.query_start_loc
    lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
    return any(n > 1 and len(split_chunk(n, cp, align)[0]) > 1 for n in lens)


class CPForward:
    """Called as the model: ``(input_ids, meta, cache) -> hidden`` of every row; the model's
    other attributes (``compute_logits``, ...) are the model's, ``mtp_forward`` split too."""

    def __init__(self, model: torch.nn.Module, group: Group, align: int) -> None:
        if "cp" not in inspect.signature(model.forward).parameters:
            raise TypeError(f"{type(model).__name__} has no context-parallel forward")
        self.model: Any = model  # forward, compute_logits, mtp_forward (LoadedModel.model)
        self.group = group
        self.align = align
        self.split_steps = 0  # steps that ran split (tests: CP really ran)
        self.mtp_split_steps = 0  # MTP prompt passes that ran split
        self.stats = CPStats()  # the per-layer gathers of every split step

    def __call__(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: object
    ) -> torch.Tensor:
        if not splits(meta, self.group.size, self.align):
            return self.model(input_ids, meta, cache)  # type: ignore[no-any-return]
        self.split_steps += 1
        share = CPShare.build(meta, self.group, self.align, self.stats)
        local = self.model(input_ids, meta, cache, cp=share)
        return share.scatter(local)

    def __getattr__(self, name: str) -> object:
        # only for what CPForward does not define itself: the runner's other model calls
        if name == "model" or name.startswith("__"):
            raise AttributeError(name)  # not built yet (copy, pickle): no recursion
        return getattr(self.model, name)

    def mtp_forward(
        self,
        next_ids: torch.Tensor,
        streams: torch.Tensor,
        meta: AttentionMetadata,
        cache: object,
        depth: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's ``mtp_forward`` (every row's inputs; this rank's rows of a split step
        filled), split like the step: every row's logits and streams come back, this rank's
        rows and each chunk's last row filled (the last rows from CP rank 0)."""
        if not splits(meta, self.group.size, self.align):
            return self.model.mtp_forward(next_ids, streams, meta, cache, depth)  # type: ignore[no-any-return]
        self.mtp_split_steps += 1
        share = CPShare.build(meta, self.group, self.align, self.stats)
        logits, out = self.model.mtp_forward(next_ids, streams, meta, cache, depth, cp=share)
        last = meta.last_token_indices()
        full = []
        for t in (share.scatter(logits), share.scatter(out)):
            t[last] = comm.broadcast(t[last].contiguous(), self.group)
            full.append(t)
        return full[0], full[1]

    def profile(self) -> dict[str, float]:
        """What the rank's profile (``DSV4_COMM_PROFILE``) records of CP."""
        return {
            "cp_threads": torch.get_num_threads(),  # the rank's intra-op threads, as it ran
            "cp_split_steps": self.split_steps,
            "cp_mtp_split_steps": self.mtp_split_steps,
            **self.stats.as_dict(),
        }
