"""Paged MLA attention over latent blocks: the C++ kernel that reads the cache in place, and a
chunked pure-torch fallback with the same contract.

Contract: ``q`` [T, H, D] float32 (absorbed queries: latent part then rope part), ``pool``
[blocks, block_size, D] (float32 or bfloat16 latents), ``block_table`` [S, max_blocks] int32,
``query_start_loc`` [S + 1] int32 (sequence s owns query rows qsl[s]:qsl[s+1]), ``seq_lens`` [S]
int32 (keys of sequence s, the new tokens included). Query j of n sits at position
``seq_len - n + j`` and sees keys up to it (causal), which covers decode (n = 1), MTP verification
(n = k + 1) and chunks. Returns [T, H, dv] float32: the softmax-weighted sum of the first ``dv``
latent channels.
"""

from __future__ import annotations

import torch

from dsv4_serving.kernels.build import available, build

GROUP = 16
"""Sequences per step of the fallback: their gathered latents stay in L3 for the re-reads."""


def paged_mla_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    dv: int,
    *,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """``use_kernel``: None picks the kernel when it builds, True requires it, False never."""
    if use_kernel is None:
        use_kernel = q.device.type == "cpu" and available("paged_mla")
    if use_kernel:
        ext = build("paged_mla")  # KernelUnavailable says why when it was required
        out: torch.Tensor = ext.paged_mla_attention(
            q.contiguous(),
            pool.contiguous(),
            block_table.to(torch.int32),
            query_start_loc.to(torch.int32),
            seq_lens.to(torch.int32),
            float(scale),
            int(dv),
        )
        return out
    return chunked(q, pool, block_table, query_start_loc, seq_lens, scale, dv)


def chunked(
    q: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    dv: int,
) -> torch.Tensor:
    """Pure torch: ``GROUP`` sequences at a time, their blocks gathered (padded to the longest),
    one batched product for the scores and one for the output, a causal mask per query."""
    t, h, d = q.shape
    out = q.new_empty((t, h, dv))
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    bs = pool.shape[1]
    for g0 in range(0, len(lens), GROUP):
        group = [s for s in range(g0, min(g0 + GROUP, len(lens))) if qsl[s + 1] > qsl[s]]
        if not group:
            continue
        n = [qsl[s + 1] - qsl[s] for s in group]
        nq, nb = max(n), -(-max(lens[s] for s in group) // bs)
        rows = block_table[group, :nb].long().reshape(-1)
        lat = pool[rows].view(len(group), nb * bs, d).float()
        qs = q.new_zeros((len(group), nq, h, d))
        for i, s in enumerate(group):
            qs[i, : n[i]] = q[qsl[s] : qsl[s + 1]]
        scores = torch.bmm(qs.view(len(group), nq * h, d), lat.transpose(1, 2)) * scale
        # query j of sequence i sees keys up to lens - n + j; padded queries see key 0 only
        last = torch.tensor(
            [[lens[s] - n[i] + min(j, n[i] - 1) for j in range(nq)] for i, s in enumerate(group)],
            device=q.device,
        )
        kpos = torch.arange(nb * bs, device=q.device)
        hidden = kpos[None, None, :] > last[:, :, None]
        scores = scores.view(len(group), nq, h, -1).masked_fill(hidden[:, :, None, :], -torch.inf)
        o = torch.bmm(scores.view(len(group), nq * h, -1).softmax(-1), lat[..., :dv])
        o = o.view(len(group), nq, h, dv)
        for i, s in enumerate(group):
            out[qsl[s] : qsl[s + 1]] = o[i, : n[i]]
    return out
