"""The EMULATED engine's step-time model (``--emulate-step-time``), pure: the engine config
validates it without loading the emulated runner (``engine/emulated/runner.py``)."""

from __future__ import annotations

from dataclasses import dataclass


class StepTimeError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class StepTime:
    """Seconds of one emulated step: ``base + per_seq x sequences + per_token x tokens``, from
    ``"base_ms,per_seq_ms,per_token_ms"``. Tokens are all the step's tokens (prefill chunks,
    decode tokens and drafts), so prompt-heavy load is bound by ``per_token`` and decode-heavy
    load by ``per_seq``, as on a real accelerator."""

    base_ms: float
    per_seq_ms: float
    per_token_ms: float

    @classmethod
    def parse(cls, text: str) -> StepTime:
        parts = text.split(",")
        if len(parts) != 3:
            raise StepTimeError(
                f"--emulate-step-time must be 'base_ms,per_seq_ms,per_token_ms', got {text!r}"
            )
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise StepTimeError(
                f"--emulate-step-time must be three numbers (milliseconds), got {text!r}"
            ) from None
        if any(not v >= 0 or v == float("inf") for v in values):
            raise StepTimeError(f"--emulate-step-time values must be finite and >= 0: {text!r}")
        return cls(*values)

    def seconds(self, num_seqs: int, num_tokens: int) -> float:
        if num_seqs == 0:
            return 0.0
        return (self.base_ms + self.per_seq_ms * num_seqs + self.per_token_ms * num_tokens) / 1e3

    def __str__(self) -> str:
        return f"{self.base_ms:g},{self.per_seq_ms:g},{self.per_token_ms:g}"
