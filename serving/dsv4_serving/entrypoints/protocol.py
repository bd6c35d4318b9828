"""OpenAI request bodies: every field of OpenAI's chat and completions requests, honoured, a
no-op, or refused (``fields``), plus vLLM's extensions this engine honours. A field nobody
defines is ignored with a log line, as vLLM does. Errors are ``dsv4_serving.http.errors``'s
common body."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.entrypoints.fields import (
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    REFUSED_MESSAGE,
    Refusal,
    refused,
)
from dsv4_serving.structured.spec import GrammarSpec, spec_from_request

log = logging.getLogger(__name__)

MAX_N = 64
"""Most samples one request may ask for (each is an engine request)."""


class _Body(BaseModel):
    """Unknown fields are dropped, with a log line (vLLM's behaviour)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                log.warning("%s: ignored unknown fields %s", cls.__name__, unknown)
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no-op: nothing is obfuscated here


class _Common(_Body):
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
    # internal, from the gateway only (``fields.INTERNAL``, ``continuation``)
    continuation: dict[str, Any] | None = None
    # vLLM's extension: the generated token ids in each choice
    return_token_ids: bool = False
    # vLLM's extension: logprobs name tokens ``token_id:<id>``, never by their text
    return_tokens_as_token_ids: bool = False
    # logits processors (``engine.sample.logits_processors``; vLLM's semantics)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None  # vLLM's extension
    # structured outputs (``structured/``): OpenAI's, and vLLM's extension
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # no-ops (``fields.NO_OPS``)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    def unsupported(self) -> Refusal | None:
        """The first field set to a value this server does not honour (``fields``)."""
        return None

    def grammar_spec(self) -> GrammarSpec | None:
        """The grammar the output must match, or None; raises ``GrammarSpecError`` (a 400)."""
        return spec_from_request(self.response_format, structured_outputs=self.structured_outputs)

    def _logit_bias(self) -> dict[int, float]:
        out = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                out[int(k)] = v
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        return out

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
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            min_p=self.min_p or 0.0,
        )


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # the prompt's text before each choice's (not its logprobs)
    suffix: str | None = None  # refused
    best_of: int | None = None  # refused above 1

    def unsupported(self) -> Refusal | None:
        return refused(self, REFUSED_COMPLETION)

    def sampling_params(self, default_max: int) -> SamplingParams:
        """``default_max`` is unused: OpenAI's completions default is 16 (``max_tokens``)."""
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (no prompt logprobs yet)")
        return self._params(self.max_tokens, self.logprobs)


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    # read by DeepSeek's chat format (``chat/``); a Jinja template ignores the last three
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    # no-ops (``fields.NO_OPS``)
    name: str | None = None
    refusal: str | None = None
    # refused (``fields.REFUSED_MESSAGE``)
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    prefix: bool | None = None  # DeepSeek's assistant prefill

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
    # DeepSeek's chat format (``chat_prompt``, ``chat_output``); values refused in
    # ``fields.REFUSED_CHAT`` are a 400 naming the field
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    thinking: dict[str, Any] | None = None  # DeepSeek's
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's
    # refused, but for harmless values (``fields.REFUSED_CHAT``)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    service_tier: str | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None  # no-op: prefix caching is automatic

    def grammar_spec(self) -> GrammarSpec | None:
        return spec_from_request(
            self.response_format,
            self.tools,
            self.tool_choice,
            self.parallel_tool_calls,
            self.structured_outputs,
        )

    def unsupported(self) -> Refusal | None:
        bad = refused(self, REFUSED_CHAT)
        for i, m in enumerate(self.messages):
            bad = bad or refused(m, REFUSED_MESSAGE, f"messages[{i}].")
        return bad

    def sampling_params(self, default_max: int) -> SamplingParams:
        """``default_max``: what is left of the context after the prompt (vLLM's default)."""
        mt = self.max_completion_tokens or self.max_tokens or default_max
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(mt, lp)
