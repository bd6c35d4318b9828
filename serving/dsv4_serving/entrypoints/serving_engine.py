"""What the completion endpoints share (vLLM's ``OpenAIServing``): every check of a request,
once, before any work (``checks``), then the work, cancelled if the client leaves or stopped
when a shutdown's grace period runs out (``disconnect.Drain``), and its span (tracing on)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dsv4_common import tracing
from dsv4_kvtransfer.pd_protocol import (
    PrefillRequestParams,
    RemotePrefillParams,
    prefill_overrides,
)
from dsv4_serving.engine.engine.async_llm import AsyncLLM, KVTransferError
from dsv4_serving.engine.engine.tokenizer import Tokenizer
from dsv4_serving.engine.kv_connector.compat import KVCompat, KVIncompatible, KVPromptMismatch
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.entrypoints import continuation
from dsv4_serving.entrypoints.chat_output import OutputSpec
from dsv4_serving.entrypoints.checks import (
    DP_RANK_HEADER,
    BadRequest,
    KVParams,
    check_dp_rank,
    check_prompt,
    parse_kv_params,
)
from dsv4_serving.entrypoints.failures import shutdown_error
from dsv4_serving.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from dsv4_serving.entrypoints.serving import CompletionGenerator
from dsv4_serving.entrypoints.streaming import HeldStream, drained
from dsv4_serving.entrypoints.tracing import answered, start_request_span
from dsv4_serving.http.disconnect import Drain, cancel_on_disconnect
from dsv4_serving.http.errors import draining_response
from dsv4_serving.structured.spec import GrammarSpec, GrammarSpecError

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)
Body = CompletionRequest | ChatCompletionRequest
Work = Coroutine[Any, Any, AsyncIterator[str] | dict[str, Any]]


class OpenAIServing:
    """The base of one endpoint family's serving class; ``chat`` says which answer it gives,
    ``prompt_param`` which field a bad prompt is blamed on."""

    chat: ClassVar[bool] = False
    prompt_param: ClassVar[str] = "prompt"

    def __init__(
        self,
        engine: AsyncLLM,
        tokenizer: Tokenizer,
        model_name: str,
        drain: Drain,
        tracer: Tracer | None,
    ) -> None:
        info = engine.info
        assert info is not None
        self.info = info
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.compat = KVCompat(
            info.architecture, info.block_size, info.num_speculative_tokens, info.kv_dtype
        )
        self.role, self.has_connector = engine.config.role, bool(engine.config.kv_sidecar)
        self.drain = drain
        self.grace = engine.config.shutdown_timeout
        self.tracer = tracer
        self.generator = CompletionGenerator(engine, tokenizer, model_name)
        self._grammar_backend: Any = None  # llguidance on this tokenizer, at the first grammar

    def check_body(self, body: Body) -> None:
        """The model is this one, and no field asks for what this server does not do."""
        name = body.model
        bad = body.unsupported()
        if bad is not None:
            raise BadRequest(bad[1], param=bad[0], code="unsupported_parameter")
        if name is not None and name != self.model_name:
            raise BadRequest(
                f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    async def respond(
        self,
        request: Request,
        body: Body,
        ids: list[int],
        echo: str | None = None,
        output: OutputSpec | None = None,
    ) -> Any:
        """Every check, once, then the work (cancelled if the client leaves, or stopped when a
        shutdown's grace period runs out). ``echo``: text put before each choice's. ``output``:
        how chat choices are parsed (their text is then decoded with special tokens)."""
        if self.drain.draining:
            return draining_response()
        arrived_ns = time.time_ns()
        kv = parse_kv_params(body.kv_transfer_params, self.role, self.has_connector)
        body = self._for_kv(body, kv)
        params = self._sampling_params(body, ids)
        if output is not None:
            params = dataclasses.replace(params, skip_special_tokens=False)
        spec = self._grammar(body, output)
        prefill = isinstance(kv, PrefillRequestParams)
        # a prefill for a remote decode checks the grammar (the 400 before any KV moves) but
        # does not apply it: the decode samples the first token the client sees
        if spec is not None and not prefill:
            params = dataclasses.replace(params, structured=spec)
        ids, params, cont = continuation.apply(
            body.continuation, self.info.vocab_size, body.stream, body.n, prefill, ids, params
        )
        if isinstance(kv, RemotePrefillParams):
            self._check_remote_kv(kv, [*ids, *cont.token_ids] if cont else ids)
        dp_rank = check_dp_rank(request.headers.get(DP_RANK_HEADER), self.info.data_parallel_size)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        span = self._start_span(request, len(ids), params.max_tokens, arrived_ns)
        work = self.generator.completion(
            ids,
            params,
            body.stream,
            include_usage,
            self.chat,
            kv,
            body.return_token_ids,
            dp_rank,
            n=body.n,
            tokens_as_ids=body.return_tokens_as_token_ids,
            echo=echo,
            output=output,
            continuation=cont,
            traceparent=tracing.traceparent(span) if span is not None else None,
        )
        return await self._serve(request, work, span)

    def _for_kv(self, body: Body, kv: KVParams | None) -> Body:
        """The body as the PD protocol has it run: one sample, and a prefill for a remote
        decode unstreamed, with the prefill's overrides."""
        if kv is not None and body.n != 1:
            raise BadRequest("n > 1 is not supported with kv_transfer_params", param="n")
        if not isinstance(kv, PrefillRequestParams):
            return body
        if body.stream:
            raise BadRequest(
                "a prefill for a remote decode (kv_transfer_params.do_remote_decode) must "
                "not stream",
                param="stream",
            )
        return body.model_copy(update=prefill_overrides(body.model_dump()))

    def _sampling_params(self, body: Body, ids: list[int]) -> SamplingParams:
        try:
            params = body.sampling_params(default_max=max(1, self.info.max_model_len - len(ids)))
        except ValueError as exc:
            # SamplingParams' messages open with the field they blame
            first = str(exc).split(" ", 1)[0]
            param = first if first in type(body).model_fields else None
            raise BadRequest(str(exc), param=param) from exc
        info = self.info
        check_prompt(ids, params.max_tokens, info.max_model_len, info.vocab_size, self.prompt_param)
        bad = sorted(t for t in params.logit_bias if t >= info.vocab_size)
        if bad:
            raise BadRequest(
                f"logit_bias: token ids out of the vocabulary [0, {info.vocab_size}): {bad[:10]}",
                param="logit_bias",
            )
        return params

    def _grammar(self, body: Body, output: OutputSpec | None) -> GrammarSpec | None:
        """The request's grammar, checked with the library the engine compiles it with."""
        try:
            spec = body.grammar_spec()
            if spec is None:
                return None
            if output is not None:
                block = output.format.call_block or spec.block
                spec = dataclasses.replace(spec, reasoning=output.thinking, block=block)
            if self._grammar_backend is None:
                from dsv4_serving.structured.llguidance_backend import LLGuidanceBackend

                info = self.info
                eos = [] if info.eos_token_id is None else [info.eos_token_id]
                if not eos:
                    raise GrammarSpecError(spec.field, "this model has no EOS token to end on")
                self._grammar_backend = LLGuidanceBackend(self.tokenizer.hf, eos, info.vocab_size)
            self._grammar_backend.check(spec)
        except GrammarSpecError as exc:
            raise BadRequest(str(exc), param=exc.field, code="invalid_grammar") from exc
        return spec

    def _check_remote_kv(self, kv: RemotePrefillParams, ids: list[int]) -> None:
        try:
            self.compat.check(kv.extra, ids)
        except KVPromptMismatch as exc:
            raise BadRequest(
                str(exc), param="kv_transfer_params", code="kv_prompt_mismatch"
            ) from exc
        except KVIncompatible as exc:
            log.error("refused a decode request: %s", exc)
            raise KVTransferError("incompatible", str(exc)) from exc

    def _start_span(
        self, request: Request, prompt_tokens: int, max_tokens: int, arrived_ns: int
    ) -> Span | None:
        if self.tracer is None:
            return None
        return start_request_span(
            self.tracer,
            request.headers,
            self.chat,
            self.model_name,
            self.role,
            prompt_tokens,
            max_tokens,
            arrived_ns,
        )

    async def _serve(self, request: Request, work: Work, span: Span | None) -> Response:
        """The answer of ``work``: JSON, or a stream that stays in flight until it is sent."""
        drain = self.drain
        drain.held += 1
        streaming = False
        try:
            try:
                result = await cancel_on_disconnect(request, drain.race(work))
            except ValueError as exc:  # the core refused it
                raise BadRequest(str(exc)) from exc
            if result is None:
                if drain.expired.is_set():
                    return shutdown_error(self.grace)
                return Response(status_code=499)  # client gone; nobody reads this
            if isinstance(result, dict):
                if span is not None:
                    answered(span, result)
                return JSONResponse(result)
            streaming = True  # the stream is in flight until it is sent
            return HeldStream(drained(result, drain, self.grace), drain, span)
        except Exception as exc:
            if span is not None:
                tracing.fail(span, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if not streaming:
                drain.held -= 1
                if span is not None:
                    span.end()
