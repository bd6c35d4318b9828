"""A grammar backend on the tiny presets' byte-level tokenizer (V4's special tokens included)."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_serving.presets.tokenizer import build_tokenizer
from dsv4_serving.structured.llguidance_backend import LLGuidanceBackend

EOS = "<｜end▁of▁sentence｜>"  # noqa: RUF001 (DeepSeek spells it with fullwidth bars)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="session")
def eos_id(tokenizer: Any) -> int:
    return int(tokenizer.token_to_id(EOS))


@pytest.fixture(scope="session")
def backend(tokenizer: Any, eos_id: int) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer, [eos_id], tokenizer.get_vocab_size())
