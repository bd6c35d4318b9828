"""The device-step seam for graphs (``--step-graphs``): decode steps of a fixed padded shape go
through one callable per shape, which a graph platform (CUDA graphs, Ascend's ACL graphs)
replaces by a graph captured for that shape; on CPU it is the eager forward.

A graph replays fixed tensor shapes, so a decode batch of ``n`` sequences runs as the smallest
**bucket** ``>= n`` (``padding_buckets``: vLLM's default capture sizes): ``bucket - n`` pad
sequences follow the real ones. Only **uniform decode** steps are padded (every request adds
exactly ``1 + num_speculative_tokens`` tokens and samples, no prefix-cache snapshot inside):
mixed and prefill steps have a shape per step and stay eager and unpadded, as in vLLM.

A pad sequence must write nowhere a real one reads: pad ``j`` is a fresh sequence (context 0)
on its own **lane**, a scratch KV block and a scratch state slot the runner's cache reserves at
start past everything the KV cache manager hands out (``runner_setup``), so no real block
table or state slot ever names them (``plan_padding`` checks it each step). One lane per pad
(not one shared block): two pads never write the same rows, which a graph's kernels need not
tolerate. Pads add ``1 + k`` tokens each (one block holds them) and their rows of the hidden
state are dropped before sampling: the real rows' tokens are exactly those of the unpadded
step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.engine.config import ConfigError
from dsv4_serving.engine.core.sched.output import ScheduledRequest

StepGraphsMode = Literal["off", "eager", "cuda", "npu"]
# graph platforms: the device they need and what they capture
GRAPH_PLATFORMS = {"cuda": ("a CUDA device", "CUDA graphs"), "npu": ("an Ascend NPU", "ACL graphs")}

# the forward over a flat batch: ``(input_ids, meta, cache) -> hidden`` of every row
StepFn = Callable[[torch.Tensor, AttentionMetadata, object], torch.Tensor]


def padding_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes a graph is captured for: vLLM's default capture sizes (1, 2, 4,
    every 8 below 256, then every 16) below ``max_num_seqs``, and ``max_num_seqs`` itself, so
    that every batch the scheduler can form has a bucket."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_num_seqs, 16)]
    return (*[s for s in sizes if s < max_num_seqs], max_num_seqs)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``n`` sequences."""
    i = bisect.bisect_left(buckets, n)
    if n < 1 or i == len(buckets):
        raise ValueError(f"no bucket for {n} sequences in {tuple(buckets)}")
    return buckets[i]


def num_lanes(buckets: Sequence[int]) -> int:
    """Pad sequences the largest gap between two buckets needs (a batch one above a bucket
    pads up to the next): the scratch blocks and slots to reserve."""
    return max(b - a - 1 for a, b in zip((0, *buckets), buckets, strict=False))


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """What a captured graph is keyed by: its sequences (a bucket) and rows per sequence."""

    seqs: int
    rows_per_seq: int  # 1 + num_speculative_tokens

    @property
    def rows(self) -> int:
        return self.seqs * self.rows_per_seq


@dataclass(frozen=True, slots=True)
class Lane:
    """A pad sequence's scratch KV block and state slot."""

    block: int
    slot: int


@dataclass(frozen=True, slots=True)
class PadPlan:
    shape: DecodeShape
    lanes: tuple[Lane, ...]  # the pads, after the real sequences, in this order


def uniform_decode(sched: Sequence[ScheduledRequest], rows_per_seq: int) -> bool:
    """Every request adds exactly ``rows_per_seq`` tokens (its token and all k drafts) and
    samples, with no snapshot inside: a shape a graph can be captured for."""
    return all(len(s.token_ids) == rows_per_seq and s.sample and not s.snapshots for s in sched)


def plan_padding(
    num_seqs: int,
    rows_per_seq: int,
    buckets: Sequence[int],
    lanes: Sequence[Lane],
    real_slots: Sequence[int],
    max_real_block: int,
) -> PadPlan:
    """The pads of a uniform decode step of ``num_seqs`` sequences: the first ``bucket -
    num_seqs`` lanes. Fails if a real sequence holds a lane's slot or a block at or past the
    first lane block (lanes are reserved past the KV cache manager's ids)."""
    seqs = bucket_for(num_seqs, buckets)
    pads = tuple(lanes[: seqs - num_seqs])
    if len(pads) < seqs - num_seqs:
        raise AssertionError(f"{seqs - num_seqs} pads needed, {len(lanes)} lanes reserved")
    if lanes:
        first_slot = min(lane.slot for lane in lanes)
        first_block = min(lane.block for lane in lanes)
        if max_real_block >= first_block or any(s >= first_slot for s in real_slots):
            raise AssertionError(
                f"a real sequence holds a pad lane's block or slot (blocks >= {first_block}, "
                f"slots >= {first_slot} are scratch): max block {max_real_block}, slots "
                f"{sorted(s for s in real_slots if s >= first_slot)}"
            )
    return PadPlan(DecodeShape(seqs, rows_per_seq), pads)


def pad_inputs(
    input_ids: torch.Tensor, meta: AttentionMetadata, plan: PadPlan
) -> tuple[torch.Tensor, AttentionMetadata]:
    """``meta``'s step with the plan's pads after its sequences: token 0 at positions
    ``0 .. q-1`` of its lane's block and slot. A new metadata (its own memo: the positions
    differ); ``meta`` itself is unchanged, the sampler and drafter read it."""
    n, q = len(plan.lanes), plan.shape.rows_per_seq
    if not n:
        return input_ids, meta
    assert meta.snapshots is None, "a padded step has no snapshots"
    t, dev = meta.num_tokens, input_ids.device
    table = meta.block_tables
    pad_rows = table.new_zeros((n, table.shape[1]))
    pad_rows[:, 0] = torch.tensor([lane.block for lane in plan.lanes], dtype=table.dtype)
    padded = AttentionMetadata(
        query_start_loc=[*meta.query_start_loc, *(t + q * (j + 1) for j in range(n))],
        context_lens=[*meta.context_lens, *([0] * n)],
        positions=torch.cat([meta.positions, torch.arange(q, device=dev).repeat(n)]),
        block_tables=torch.cat([table, pad_rows]),
        num_blocks=[*meta.num_blocks, *([1] * n)],
        state_slots=[*meta.state_slots, *(lane.slot for lane in plan.lanes)],
    )
    return torch.cat([input_ids, input_ids.new_zeros(n * q)]), padded


# a platform's capture: the callable that runs steps of one shape (a graph's replay)
Capture = Callable[[DecodeShape, StepFn], StepFn]


def eager(shape: DecodeShape, fn: StepFn) -> StepFn:
    """CPU (and ``--step-graphs eager`` anywhere): the forward itself, run eagerly."""
    return fn


def capture_for(mode: StepGraphsMode, device_type: str) -> Capture:
    """The capture of ``mode`` on a ``device_type`` engine; a graph platform fails fast at
    start, naming the hardware it needs when the engine is not on it."""
    if mode == "eager":
        return eager
    if mode not in GRAPH_PLATFORMS:
        raise ConfigError(f"step_graphs must be off, eager, cuda or npu, got {mode!r}")
    need, what = GRAPH_PLATFORMS[mode]
    if device_type != mode:
        raise ConfigError(
            f"--step-graphs {mode} captures decode steps as {what}: it needs {need}, and this "
            f"engine runs on {device_type}; --step-graphs eager runs the same padded shapes "
            "eagerly"
        )
    raise ConfigError(
        f"--step-graphs {mode}: capturing decode steps as {what} is not built yet (the seam's "
        "capture hook, engine/worker/step_graphs.py); --step-graphs eager runs the same padded "
        "shapes eagerly"
    )


class StepGraphs:
    """The seam: a uniform decode step is padded to its bucket and run by its shape's
    callable, made by the platform's ``capture`` at the shape's first step; any other step
    runs ``forward`` as it is."""

    def __init__(
        self,
        forward: StepFn,
        buckets: Sequence[int],
        lanes: Sequence[Lane],
        rows_per_seq: int,
        block_size: int,
        capture: Capture = eager,
    ) -> None:
        if rows_per_seq > block_size:
            raise ValueError(f"a pad's {rows_per_seq} rows do not fit one block of {block_size}")
        if len(lanes) < num_lanes(buckets):
            raise ValueError(f"{num_lanes(buckets)} pad lanes needed, {len(lanes)} given")
        self.forward = forward
        self.buckets = tuple(buckets)
        self.lanes = tuple(lanes)
        self.rows_per_seq = rows_per_seq
        self.capture = capture
        self.graphs: dict[DecodeShape, StepFn] = {}
        self.padded_steps = 0  # steps that ran through a shape's callable (tests)
        self.pad_rows = 0  # rows of pads run so far (their compute is the padding's cost)

    def run(
        self, shape: DecodeShape, input_ids: torch.Tensor, meta: AttentionMetadata, cache: object
    ) -> torch.Tensor:
        """Run a step of ``shape`` by its callable (captured at its first step)."""
        fn = self.graphs.get(shape)
        if fn is None:
            fn = self.graphs[shape] = self.capture(shape, self.forward)
        return fn(input_ids, meta, cache)

    def step(
        self,
        sched: Sequence[ScheduledRequest],
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: object,
    ) -> torch.Tensor:
        """The hidden state of the step's real rows (the runner's forward call)."""
        if not uniform_decode(sched, self.rows_per_seq):
            return self.forward(input_ids, meta, cache)
        table = meta.block_tables
        top = int(table.max()) if table.numel() else 0
        plan = plan_padding(
            len(sched), self.rows_per_seq, self.buckets, self.lanes, meta.state_slots, top
        )
        ids, padded = pad_inputs(input_ids, meta, plan)
        self.padded_steps += 1
        self.pad_rows += ids.numel() - input_ids.numel()
        return self.run(plan.shape, ids, padded, cache)[: meta.num_tokens]
