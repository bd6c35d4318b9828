"""Sampling and speculative verification over logits rows.

Bias and penalties come first (``logits_processors``, per row, drafts included). Greedy rows
then take the argmax. Random rows apply temperature, min_p, top-k and top-p, then draw with
the request's own generator (seeded requests draw from their seed alone, whatever else is in
the batch, and each output position from its own: ``sample/seeding.py``). Drafts (greedy from
the MTP layer, so the draft distribution q is one-hot) are verified by drawing each position's
token x ~ p from that position's generator and keeping draft d iff x == d; at the first
mismatch x is the output. That is rejection sampling for one-hot q: d is kept with
probability p(d) = min(1, p(d) / q(d)), and on rejection x is distributed as p without d,
norm(max(p - q, 0)); so the output distribution is exactly p, and a seeded request's token at
a position depends on (seed, position, logits) only, not on how many drafts a step had (what
makes a continued stream exact with MTP). With greedy requests it reduces to "keep while
equal to the argmax". Logprobs are the model's raw log-softmax, as vLLM returns by default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_serving.engine.request import Logprob
from dsv4_serving.engine.sample.logits_processors import TokenHistory, apply_min_p, process_logits
from dsv4_serving.engine.sample.sampling_params import SamplingParams


def probs_from_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Sampling distribution of rows ``[n, V]`` (float32) after temperature, min_p, top-k,
    top-p (``logits`` already carry the bias and penalties)."""
    x = apply_min_p(logits.float() / max(sp.temperature, 1e-5), sp.min_p)
    if sp.top_k > 0 and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -torch.inf)
    if sp.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the ones before it already reach top_p (the top one always stays)
        drop = (cum - sorted_x.softmax(dim=-1)) >= sp.top_p
        # explicitly: a top_p below float32's range (1e-313) is 0 here, and 0 >= 0 would drop
        # every token (a NaN distribution that killed the core; found by fuzzing)
        drop[..., 0] = False
        sorted_x = sorted_x.masked_fill(drop, -torch.inf)
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return x.softmax(dim=-1)


def _draw(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=gen).item())


def sample_and_verify(
    logits: torch.Tensor,
    drafts: list[int],
    sp: SamplingParams,
    gen: torch.Generator | None,
    hist: TokenHistory | None = None,
    position_gen: Callable[[int], torch.Generator] | None = None,
) -> list[int]:
    """``logits`` has ``len(drafts) + 1`` rows (row i predicts the token after input i).
    Returns the kept drafts followed by one token of the model's own: 1..len(drafts)+1 ids.
    ``hist``: the request's token counts, when its penalties need them. ``position_gen``: the
    generator of row i's position (a seeded request), else every row draws from ``gen``."""
    if sp.moves_argmax:
        logits = process_logits(logits, sp, hist, drafts)
    if sp.greedy:
        target = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for i, d in enumerate(drafts):
            if target[i] != d:
                out.append(target[i])
                return out
            out.append(d)
        out.append(target[len(drafts)])
        return out
    probs = probs_from_logits(logits, sp).cpu()
    out = []
    for i in range(len(drafts) + 1):
        x = _draw(probs[i], position_gen(i) if position_gen is not None else gen)
        out.append(x)
        if i == len(drafts) or x != drafts[i]:  # the bonus token, or the first mismatch
            break
    return out


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], n_top: int) -> list[Logprob]:
    """Raw logprob of each chosen token (row i -> token_ids[i]) and the n_top best."""
    lp = torch.log_softmax(logits[: len(token_ids)].float(), dim=-1).cpu()
    out = []
    for i, t in enumerate(token_ids):
        top: list[tuple[int, float]] = []
        if n_top > 0:
            vals, idx = torch.topk(lp[i], n_top)
            top = list(zip(idx.tolist(), vals.tolist(), strict=True))
        out.append(Logprob(t, float(lp[i, t]), top))
    return out
