"""The logits a request samples from (vLLM's semantics and order), per row:

    logit_bias -> repetition -> frequency / presence -> temperature -> min_p -> top-k / top-p

``logit_bias`` is added (-inf stays -inf). ``repetition_penalty`` r acts on every token of the
prompt or the output: a positive logit is divided by r, a negative one multiplied. Frequency
and presence act on the output: ``logit -= frequency * count + presence * (count > 0)``.
Temperature, min_p, top-k and top-p are the sampler's (``probs_from_logits``); they never move
the argmax, so greedy rows take the argmax of bias and penalties alone.

Counts live in a ``TokenHistory`` per request, on the logits' device, updated with each
accepted token (never rebuilt from the sequence). A verification step has one row per draft
plus one: row i follows drafts[:i], so its counts include them, and a draft is judged exactly
as if the tokens before it had been sampled one step at a time (MTP on and off give the same
greedy tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4_serving.engine.sample.sampling_params import SamplingParams


class TokenHistory:
    """One request's output token counts and the set of its prompt tokens (for the
    repetition penalty only), as ``[V]`` tensors. A continued stream's prompt ends with the
    ``sp.resumed_tokens`` tokens another engine generated: they count as output, so the
    penalties go on as on the first engine."""

    __slots__ = ("counts", "prompt")

    def __init__(
        self, prompt_ids: Sequence[int], vocab: int, device: torch.device, sp: SamplingParams
    ) -> None:
        cut = len(prompt_ids) - sp.resumed_tokens
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.prompt: torch.Tensor | None = None
        if sp.repetition_penalty != 1.0:
            self.prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = torch.tensor(list(prompt_ids[:cut]), dtype=torch.long, device=device)
            self.prompt[prompt] = True
        if sp.resumed_tokens:
            self.add(prompt_ids[cut:])

    def add(self, ids: Sequence[int]) -> None:
        """Count accepted output tokens."""
        idx = torch.tensor(list(ids), dtype=torch.long, device=self.counts.device)
        self.counts.index_put_((idx,), torch.ones_like(idx, dtype=torch.float32), accumulate=True)

    def row_counts(self, drafts: Sequence[int]) -> torch.Tensor:
        """``[len(drafts) + 1, V]``: row i counts the output plus drafts[:i]."""
        n = len(drafts) + 1
        counts = self.counts.expand(n, -1).clone()
        for i, d in enumerate(drafts, start=1):
            counts[i:, d] += 1.0
        return counts


def _apply_bias(x: torch.Tensor, bias: dict[int, float]) -> None:
    ids = torch.tensor(list(bias), dtype=torch.long, device=x.device)
    x[:, ids] += torch.tensor(list(bias.values()), dtype=x.dtype, device=x.device)


def _apply_penalties(
    x: torch.Tensor, sp: SamplingParams, hist: TokenHistory, drafts: Sequence[int]
) -> torch.Tensor:
    counts = hist.row_counts(drafts)
    seen = counts > 0
    r = sp.repetition_penalty
    if r != 1.0:
        rep = seen if hist.prompt is None else seen | hist.prompt
        x = torch.where(rep, torch.where(x > 0, x / r, x * r), x)
    if sp.frequency_penalty:
        x = x - sp.frequency_penalty * counts
    if sp.presence_penalty:
        x = x - sp.presence_penalty * seen.float()
    return x


def process_logits(
    logits: torch.Tensor,
    sp: SamplingParams,
    hist: TokenHistory | None,
    drafts: Sequence[int] = (),
) -> torch.Tensor:
    """Rows ``[len(drafts) + 1, V]`` after logit_bias and the penalties (float32, a new
    tensor; ``logits`` is left as it is, for the raw logprobs)."""
    x = logits.to(torch.float32, copy=True)  # one copy, whatever the dtype
    if sp.logit_bias:
        _apply_bias(x, sp.logit_bias)
    if sp.uses_history:
        assert hist is not None, "penalties need the request's token history"
        x = _apply_penalties(x, sp, hist, drafts)
    return x


def apply_min_p(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop (to -inf) the tokens whose probability is below ``min_p`` times the row's best;
    ``x`` is already divided by the temperature."""
    if min_p <= 0.0:
        return x
    p = x.softmax(dim=-1)
    keep = p >= min_p * p.amax(dim=-1, keepdim=True)
    return x.masked_fill(~keep, -torch.inf)
