"""Rank bodies of the dist tier (module-level, so spawned ranks can import them).

Every rank builds the unsplit module or model itself from the same dummy seed (the split one
slices the same logical tensors), so each comparison is local: split vs single.
"""

from __future__ import annotations

from typing import Any

import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.distributed.groups import ModelParallel
from dsv4_serving.distributed.parallel_state import (
    FingerprintError,
    destroy_distributed,
    get_world_group,
    init_distributed,
)
from dsv4_serving.distributed.topology import Topology
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.models.registry import REGISTRY
from dsv4_serving.presets.configs import preset_config

BLOCK = 16


def join(rank: int, port: int, topo: Topology, **kw: Any) -> ModelParallel:
    return init_distributed(topo, rank, master_addr="127.0.0.1", master_port=port, **kw)


def world_variants(kind: str) -> ModelParallel:
    """The model-layer layouts 2 ranks can take, all over the one world group."""
    w = get_world_group()
    return {
        "tp2": ModelParallel(tp=w),
        "tp2-ep2": ModelParallel(tp=w, ep=w),
        "tp2-ep2-exact": ModelParallel(tp=w, ep=w, exact_moe=True),
        "dp2-ep2": ModelParallel(dp=w, ep=w),
        "dp2-ep2-exact": ModelParallel(dp=w, ep=w, exact_moe=True),
    }[kind]


# ---- models: prefill + decode steps on the cache -------------------------------------------


def build_model(preset: str, parallel: ModelParallel, seed: int = 3) -> torch.nn.Module:
    cfg = preset_config(preset)
    cls = REGISTRY.resolve(cfg["architectures"][0])
    model = cls(cls.config_class.from_dict(cfg), parallel).float().eval()
    init_dummy_weights(model, seed)
    return model


def _meta(starts: list[int], news: list[int], blocks_per_seq: int) -> AttentionMetadata:
    chunks = [
        SeqChunk(c, n, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), i)
        for i, (c, n) in enumerate(zip(starts, news, strict=True))
    ]
    return AttentionMetadata.build(chunks, BLOCK)


def run_model(model: Any, prompts: list[list[int]], feeds: list[list[int]]) -> torch.Tensor:
    """Last-token logits [steps + 1, B, 2V], main model then MTP draft: the prompts prefilled
    together, then one decode step per column of ``feeds`` (fixed tokens, so every layout
    follows the same path); the MTP layer drafts from every step's hidden states."""
    steps = len(feeds[0])
    nb = -(-max(len(p) + len(f) for p, f in zip(prompts, feeds, strict=True)) // BLOCK)
    cache = model.allocate_cache(nb * len(prompts), BLOCK, len(prompts))
    seqs = [list(p) for p in prompts]
    out = []
    with torch.no_grad():
        meta = _meta([0] * len(seqs), [len(p) for p in seqs], nb)
        news = seqs
        for step in range(steps + 1):
            h = model(torch.tensor([t for n in news for t in n]), meta, cache)
            # the MTP layer reads (hidden at p, token at p + 1): shift each sequence by one
            after = [f[step] if step < steps else 0 for f in feeds]
            nxt = torch.tensor([t for n, a in zip(news, after, strict=True) for t in [*n[1:], a]])
            draft, _ = model.mtp_forward(nxt, h, meta, cache)
            last = meta.last_token_indices()
            out.append(torch.cat((model.compute_logits(h[last]), draft[last]), dim=-1))
            if step == steps:
                break
            news = [[a] for a in after]
            meta = _meta(meta.seq_lens(), [1] * len(seqs), nb)
    return torch.stack(out)


def workload(vocab: int, seed: int = 7) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 20, 29, 12)]
    feeds = [torch.randint(0, vocab, (5,), generator=g).tolist() for _ in prompts]
    return prompts, feeds


def compare_models(parallel: ModelParallel, label: str) -> dict[str, float]:
    """max|diff| / (1e-4 x logit scale) per preset: <= 1 is within docs/models.md's bound.
    DP ranks each run their own sequences (every dp-th one)."""
    out = {}
    for preset in ("dsv4-tiny", "dsv3-small"):
        prompts, feeds = workload(preset_config(preset)["vocab_size"])
        ref = run_model(build_model(preset, ModelParallel()), prompts, feeds)
        dp = parallel.dp
        mine = list(range(dp.index, len(prompts), dp.size))
        got = run_model(
            build_model(preset, parallel), [prompts[i] for i in mine], [feeds[i] for i in mine]
        )
        want = ref[:, mine]
        out[f"{preset}/{label}"] = float((got - want).abs().max() / (1e-4 * want.abs().max()))
    return out


def models_world2(rank: int, world: int, port: int) -> dict[str, float]:
    join(rank, port, Topology(tp=2, ep=2))
    try:
        out: dict[str, float] = {}
        for kind in ("tp2", "tp2-ep2", "dp2-ep2", "dp2-ep2-exact"):
            out |= compare_models(world_variants(kind), kind)
        return out
    finally:
        destroy_distributed()


def models_tp2_dp2(rank: int, world: int, port: int) -> dict[str, float]:
    par = join(rank, port, Topology(tp=2, dp=2, ep=4))
    try:
        out = compare_models(par, "tp2xdp2-ep4")
        return out | compare_models(ModelParallel(tp=par.tp, dp=par.dp), "tp2xdp2-ep1")
    finally:
        destroy_distributed()


# ---- process groups --------------------------------------------------------------------------


def fingerprint_mismatch(rank: int, world: int, port: int) -> str:
    fp = {"tp": 1, "dp": 2, "model": "dsv4-tiny", "dtype": "float32", "block_size": 16}
    if rank == 1:
        fp["dp"] = 1
    try:
        join(rank, port, Topology(dp=2), fingerprint=fp, timeout_s=30)
    except FingerprintError as exc:
        return str(exc)
    destroy_distributed()
    return "no error"


def collectives(rank: int, world: int, port: int) -> dict[str, Any]:
    from dsv4_serving.distributed import comm

    join(rank, port, Topology(dp=2))
    try:
        w = get_world_group()
        x = torch.arange(3.0) + 10 * rank
        rows = torch.full((rank + 1, 2), float(rank))  # uneven: 1 row, then 2
        sizes = comm.all_gather_sizes(rows.shape[0], w, rows.device)
        gathered = comm.all_gatherv(rows, sizes, w)
        return {
            "all_reduce": comm.all_reduce(x.clone(), w).tolist(),
            "all_gather": comm.all_gather(x, w).tolist(),
            "sizes": sizes,
            "all_gatherv": gathered[:, 0].tolist(),
            "reduce_scatterv": comm.reduce_scatterv(gathered, sizes, w)[:, 0].tolist(),
            "broadcast": comm.broadcast_object({"from": rank}, w),
            "gather": comm.gather_object(rank * 10, w),
        }
    finally:
        destroy_distributed()


def all_to_all(rank: int, world: int, port: int, shm: bool) -> dict[str, Any]:
    """``all_to_allv`` with uneven splits: over the shared-memory channel (an all-gather) or
    over gloo's native ``all_to_all_single``; values name (sender, receiver, row)."""
    import os

    from dsv4_serving.distributed import comm
    from dsv4_serving.distributed.shm_comm import DISABLE_ENV

    if not shm:
        os.environ[DISABLE_ENV] = "0"
    join(rank, port, Topology(dp=2))
    try:
        w = get_world_group()
        matrix = ([1, 2], [3, 0])  # rows member i sends member j
        send, recv = matrix[rank], [matrix[j][rank] for j in range(2)]
        rows = [100 * rank + 10 * dst + i for dst, n in enumerate(send) for i in range(n)]
        x = torch.tensor(rows, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
        got = comm.all_to_allv(x, send, recv, w)
        return {
            "shm": w.shm is not None,
            "rows": got[:, 0].tolist(),
            "equal_cols": bool((got == got[:, :1]).all()),
        }
    finally:
        destroy_distributed()


def world_mismatch(rank: int, world: int, port: int) -> str:
    """Rank 1 started with another shape than rank 0 (a node with other sizes)."""
    from dsv4_serving.distributed.parallel_state import RendezvousError

    topo = Topology(tp=2, nnodes=2) if rank == 0 else Topology(tp=2, dp=2, nnodes=2)
    try:
        join(rank, port, topo, timeout_s=30)
    except RendezvousError as exc:
        return str(exc)
    destroy_distributed()
    return "no error"


def one_rank_fails(rank: int, world: int, port: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    join(rank, port, Topology(dp=2), timeout_s=60)  # waits for rank 1 until killed


def sizes_of_the_world(rank: int, world: int, port: int) -> tuple[int, int]:
    return rank, world
