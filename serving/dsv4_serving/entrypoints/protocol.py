"""OpenAI request bodies (the fields this engine honours; unknown fields are ignored, as
OpenAI-compatible servers do). Errors are ``dsv4_serving.http.errors``'s common body."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dsv4_serving.engine.sample.sampling_params import SamplingParams

MAX_N = 64
"""Most samples one request may ask for (each is an engine request)."""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    min_tokens: int = 0
    # the PD protocol (vLLM's): a prefill for a remote decode, or a decode of remote KV
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's extension: the generated token ids in each choice
    return_token_ids: bool = False
    # vLLM's extension: logprobs name tokens ``token_id:<id>``, never by their text
    return_tokens_as_token_ids: bool = False

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=16 if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def sampling_params(self, default_max: int) -> SamplingParams:
        """``default_max`` is unused: OpenAI's completions default is 16 (``max_tokens``)."""
        if self.echo:
            raise ValueError("echo is not supported")
        return self._params(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self, default_max: int) -> SamplingParams:
        """``default_max``: what is left of the context after the prompt (vLLM's default)."""
        mt = self.max_completion_tokens or self.max_tokens or default_max
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(mt, lp)
