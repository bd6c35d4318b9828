"""The logits chain (bias -> repetition -> frequency/presence -> temperature -> min_p ->
top-k/top-p) against a plain per-token reference on fixed logits, drafts counted per row,
and the validation of its parameters."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dsv4_serving.engine.sample.logits_processors import TokenHistory, process_logits
from dsv4_serving.engine.sample.sampler import probs_from_logits, sample_and_verify
from dsv4_serving.engine.sample.sampling_params import SamplingParams

V = 6
RAW = [2.0, -1.0, 0.5, -0.5, 1.0, 0.0]
PROMPT = [3]


def reference(
    raw: list[float], sp: SamplingParams, prompt: list[int], out: list[int]
) -> list[float]:
    """The chain written token by token (vLLM's formulas)."""
    x = list(raw)
    for t, b in sp.logit_bias.items():
        x[t] += b
    for t in range(len(x)):
        c = out.count(t)
        if t in prompt or c:
            r = sp.repetition_penalty
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty * (c > 0)
    return x


def _hist(sp: SamplingParams, out: list[int]) -> TokenHistory:
    h = TokenHistory(PROMPT, V, torch.device("cpu"), sp)
    h.add(out)
    return h


SP = SamplingParams(
    temperature=0,
    presence_penalty=0.5,
    frequency_penalty=0.25,
    repetition_penalty=2.0,
    logit_bias={1: 3.0, 5: -100.0},
)


def test_the_chain_gives_the_reference_values_exactly() -> None:
    out = [0, 0, 2]
    got = process_logits(torch.tensor([RAW]), SP, _hist(SP, out))
    want = reference(RAW, SP, PROMPT, out)
    assert got[0].tolist() == pytest.approx(want, abs=0)
    # 0: 2/2 - 0.25*2 - 0.5 = 0; 1: -1+3 = 2 (not seen); 3: in the prompt, -0.5*2 = -1
    assert want[:4] == [0.0, 2.0, 0.25 - 0.25 - 0.5, -1.0]


def test_a_continued_stream_s_history_counts_the_resumed_tokens_as_output() -> None:
    """Prompt [3] + [0, 0, 2] another engine generated gives the first engine's logits."""
    out = [0, 0, 2]
    sp = dataclasses.replace(SP, resumed_tokens=len(out))
    h = TokenHistory(PROMPT + out, V, torch.device("cpu"), sp)
    got = process_logits(torch.tensor([RAW]), sp, h)
    assert got[0].tolist() == pytest.approx(reference(RAW, SP, PROMPT, out), abs=0)
    assert h.counts.tolist() == [2.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert h.prompt is not None and h.prompt.tolist() == [False, False, False, True, False, False]


def test_each_draft_row_counts_the_drafts_before_it() -> None:
    drafts = [4, 4]
    out = [0]
    rows = process_logits(torch.tensor([RAW] * 3), SP, _hist(SP, out), drafts)
    for i in range(3):
        want = reference(RAW, SP, PROMPT, out + drafts[:i])
        assert rows[i].tolist() == pytest.approx(want, abs=1e-6)


def test_greedy_verification_with_penalties_equals_one_token_at_a_time() -> None:
    sp = SamplingParams(temperature=0, frequency_penalty=2.0)
    logits = torch.tensor([[3.0, 2.0, 0.0]] * 3)  # the model always prefers token 0
    one_by_one: list[int] = []
    h = TokenHistory([], 3, torch.device("cpu"), sp)
    for _ in range(3):
        (t,) = sample_and_verify(logits[:1], [], sp, None, h)
        h.add([t])
        one_by_one.append(t)
    assert one_by_one == [0, 1, 0]  # 3-2=1 < 2 after one 0; then 0 at 1 vs 1 at 0
    h2 = TokenHistory([], 3, torch.device("cpu"), sp)
    assert sample_and_verify(logits, one_by_one[:2], sp, None, h2) == one_by_one
    assert sample_and_verify(logits, [0, 0], sp, None, h2) == [0, 1]  # 2nd draft rejected


def test_bias_plus_100_forces_a_token_and_minus_inf_stays() -> None:
    sp = SamplingParams(temperature=0, logit_bias={2: 100.0})
    assert sample_and_verify(torch.tensor([RAW]), [], sp, None) == [2]
    x = process_logits(
        torch.tensor([[-math.inf, 0.0]]), SamplingParams(logit_bias={0: 100.0}), None
    )
    assert x[0, 0] == -math.inf


def test_min_p_drops_tokens_below_its_share_of_the_best_after_temperature() -> None:
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    p = probs_from_logits(logits, SamplingParams(min_p=0.2))  # keep p >= 0.1
    assert p[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    p2 = probs_from_logits(logits, SamplingParams(min_p=0.2, temperature=0.5))
    # at temperature 0.5 the shares are squared: 0.05**2 and 0.15**2 fall below 0.2 * 0.25
    assert (p2[0, 2:] == 0).all() and p2[0, 0] > p2[0, 1] > 0


def test_logprobs_stay_raw_and_the_fast_path_is_for_rows_without_processors() -> None:
    assert not SamplingParams(temperature=0, min_p=0.5).moves_argmax
    assert SamplingParams(temperature=0, logit_bias={1: 1.0}).moves_argmax
    assert SamplingParams(repetition_penalty=1.1).uses_history
    assert not SamplingParams(logit_bias={1: 1.0}).uses_history


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kw)  # type: ignore[arg-type]
