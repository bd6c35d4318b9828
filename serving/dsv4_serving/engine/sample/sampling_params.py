"""Sampling parameters of one request, validated where they enter (bad values -> ValueError,
which the API turns into HTTP 400)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dsv4_serving.structured.spec import GrammarSpec

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    seed: int | None = None
    """Per-request random seed: the same seed and prompt give the same tokens."""
    max_tokens: int = 16
    """Most tokens to generate."""
    min_tokens: int = 0
    """Stop conditions other than max_tokens are ignored before this many tokens."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the text returned ends before the first one found (checked by the front
    end, which detokenizes)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request (kept in the output, like EOS)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many most likely alternatives (0-20)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output ([-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it is in the output ([-2, 2])."""
    repetition_penalty: float = 1.0
    """Tokens in the prompt or the output: a positive logit is divided by it, a negative one
    multiplied (> 0; 1 = off; vLLM's and the CTRL paper's rule)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of these token ids ([-100, 100]; the API checks the ids)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's ([0, 1])."""
    skip_special_tokens: bool = True
    """Decode the output without special tokens (vLLM's field); the chat output parser needs
    them (``</think>``, EOS) and sets it False."""
    structured: GrammarSpec | None = None
    """The grammar the output must match (``response_format``, ``tool_choice`` required or
    named): a token mask before sampling, on the rank that samples (``structured/``)."""
    resumed_tokens: int = 0
    """The prompt's last ``resumed_tokens`` ids are output another engine generated (a
    continued stream, ``entrypoints/continuation.py``): the grammar's matcher is advanced over
    them before the first sample, and the penalties count them as output."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.top_k == -1:
            self.top_k = 0
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        bad = {t: b for t, b in self.logit_bias.items() if not -100.0 <= b <= 100.0}
        if bad:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bad}")
        negative = [t for t in self.logit_bias if t < 0]
        if negative:
            raise ValueError(f"logit_bias token ids must be >= 0, got {negative}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_history(self) -> bool:
        """The penalties read the request's prompt and output token counts."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def moves_argmax(self) -> bool:
        """Bias or penalties change the logits before any draw: greedy rows cannot take the
        model's plain argmax (temperature, min_p, top-k and top-p keep it)."""
        return self.uses_history or bool(self.logit_bias)
