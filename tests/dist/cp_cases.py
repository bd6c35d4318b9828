"""Rank bodies of the context-parallel dist tests (module-level, so spawned ranks can import
them): dsv4-tiny's and dsv3-small's (MLA) prefill and decode steps with a step's rows split
over the CP group (``attention/cp.py:CPShare``) against the same model in one process."""

from __future__ import annotations

import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.attention.cp import CPShare, CPStats
from dsv4_serving.distributed.groups import ModelParallel
from dsv4_serving.distributed.parallel_state import destroy_distributed, get_world_group
from dsv4_serving.distributed.topology import Topology

from .cases import BLOCK, build_model, join

# (context, new tokens) per sequence and step: 0 is split in two chunks, 1 split once, 2 too
# short to split; then decodes (replicated on every rank)
STEPS = [
    [(0, 200), (0, 90), (0, 20)],
    [(200, 100), (90, 1), (20, 1)],
    [(300, 1), (91, 1), (21, 1)],
]
LENGTHS = [301, 92, 22]


def _meta(step: list[tuple[int, int]]) -> AttentionMetadata:
    nb = -(-max(LENGTHS) // BLOCK)
    chunks = [SeqChunk(c, n, list(range(i * nb, (i + 1) * nb)), i) for i, (c, n) in enumerate(step)]
    return AttentionMetadata.build(chunks, BLOCK)


def _run(model: torch.nn.Module, cp: CPStats | None) -> list[torch.Tensor]:
    """Every row's logits per step (CP: each rank's rows gathered back to flat order)."""
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, 264, (n,), generator=g) for n in LENGTHS]
    nb = -(-max(LENGTHS) // BLOCK)
    cache = model.allocate_cache(nb * len(LENGTHS), BLOCK, len(LENGTHS))  # type: ignore[operator]
    out = []
    with torch.no_grad():
        for step in STEPS:
            meta = _meta(step)
            tokens = torch.cat([ids[i][c : c + n] for i, (c, n) in enumerate(step)])
            if cp is None:
                out.append(model.compute_logits(model(tokens, meta, cache)))  # type: ignore[operator]
                continue
            share = CPShare.build(meta, get_world_group(), align=BLOCK, stats=cp)
            streams = model(tokens, meta, cache, cp=share)  # type: ignore[operator]
            (flat,) = share.gather([streams.flatten(1)])
            out.append(model.compute_logits(flat.view(-1, *streams.shape[1:])))  # type: ignore[operator]
    return out


def cp_logits(rank: int, world: int, port: int, preset: str) -> dict[str, float]:
    """max|diff| / (1e-4 x logit scale) of every row's logits per step (<= 1 passes), and
    what the rank's gathers counted (``CPStats``)."""
    join(rank, port, Topology(dp=world), timeout_s=600.0)  # the reference run first, unevenly
    try:
        model = build_model(preset, ModelParallel())
        want = _run(model, cp=None)
        stats = CPStats()
        got = _run(model, cp=stats)
        return {
            f"step{i}": float((a - b).abs().max() / (1e-4 * b.abs().max()))
            for i, (a, b) in enumerate(zip(got, want, strict=True))
        } | {
            "bitwise": float(all(torch.equal(a, b) for a, b in zip(got, want, strict=True))),
            "gathers": stats.gathers,
            "bytes_sent": stats.bytes_sent,
            "bytes_received": stats.bytes_received,
        }
    finally:
        destroy_distributed()


def _run_mtp(model: torch.nn.Module, cp: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the MTP layer's logits over every row of the step and which rows this rank
    checks, the main model then the MTP layer as the engine runs them (CP: through
    ``CPForward``, its own rows and each chunk's last row)."""
    from dsv4_serving.engine.worker.cp_runner import CPForward

    g = torch.Generator().manual_seed(12)
    ids = [torch.randint(0, 264, (n + 1,), generator=g) for n in LENGTHS]
    nb = -(-max(LENGTHS) // BLOCK)
    cache = model.allocate_cache(nb * len(LENGTHS), BLOCK, len(LENGTHS))  # type: ignore[operator]
    fwd = CPForward(model, get_world_group(), BLOCK) if cp else model
    out = []
    with torch.no_grad():
        for step in STEPS:
            meta = _meta(step)
            tokens = torch.cat([ids[i][c : c + n] for i, (c, n) in enumerate(step)])
            nxt = torch.cat([ids[i][c + 1 : c + n + 1] for i, (c, n) in enumerate(step)])
            hidden = fwd(tokens, meta, cache)
            logits, _ = fwd.mtp_forward(nxt, hidden, meta, cache)  # type: ignore[operator]
            rows = torch.ones(meta.num_tokens, dtype=torch.bool)
            if cp and isinstance(fwd, CPForward) and fwd.split_steps and meta.num_tokens > 3:
                rows = CPShare.build(meta, get_world_group(), BLOCK).mask.clone()
                rows[meta.last_token_indices()] = True
            out.append((logits, rows))
    return out


def cp_mtp_logits(rank: int, world: int, port: int, preset: str) -> dict[str, float]:
    """The MTP layer under CP (``CPForward.mtp_forward``): per step, max|diff| / (1e-4 x
    logit scale) of its logits on the rows this rank has (its own and each chunk's last;
    <= 1 passes) against one process; later steps read the MTP cache the split steps wrote."""
    join(rank, port, Topology(dp=world), timeout_s=600.0)
    try:
        model = build_model(preset, ModelParallel())
        want = _run_mtp(model, cp=False)
        got = _run_mtp(model, cp=True)
        res: dict[str, float] = {}
        for i, ((a, rows), (b, _)) in enumerate(zip(got, want, strict=True)):
            res[f"step{i}"] = float((a[rows] - b[rows]).abs().max() / (1e-4 * b.abs().max()))
            res[f"rows{i}"] = int(rows.sum())
        return res
    finally:
        destroy_distributed()
