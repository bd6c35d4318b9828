"""Completions and chat completions on top of ``AsyncLLM``: OpenAI response bodies, SSE
chunks, usage, logprobs (``logprobs``), and ``n`` > 1.

``n`` samples are ``n`` engine requests of the same prompt: the first runs alone until its
prompt is computed (its first token), then the others start and find the prompt's full KV
blocks in the prefix cache. With a ``seed``, sample ``i`` uses ``seed + i`` (vLLM's rule), so
sample 0 is what ``n=1`` with that seed gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from dsv4_kvtransfer.pd_protocol import PrefillRequestParams, PrefixPullParams, RemotePrefillParams
from dsv4_serving.chat.dsml import THINK_CLOSE
from dsv4_serving.engine.engine.async_llm import AsyncLLM, RequestOutput
from dsv4_serving.engine.engine.tokenizer import Tokenizer
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.entrypoints.chat_output import ChoiceOutput, OutputSpec
from dsv4_serving.entrypoints.continuation import (
    Continuation,
    StateWriter,
    prime,
    resume_args,
    sent_text,
)
from dsv4_serving.entrypoints.logprobs import ChoiceLogprobs

Indexed = tuple[int, RequestOutput]


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(last: dict[int, RequestOutput], reasoning_tokens: int | None = None) -> dict[str, Any]:
    """One prompt, ``n`` completions; cached tokens: the most any sample found cached.
    ``reasoning_tokens``: all samples' (chat answers in DeepSeek's format)."""
    outs = list(last.values())
    prompt = outs[0].num_prompt_tokens
    completion = sum(o.num_output_tokens for o in outs)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": max(o.num_cached_tokens for o in outs)},
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index``'s params: its own seed (``seed + index``) when a seed is given."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**63)


async def _merged(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[Indexed]:
    """The increments of several requests as they come, tagged with their index. Sample 0
    goes first alone until its first increment (its prompt is in the prefix cache then);
    leaving early closes every generator (which aborts its request)."""
    queue: asyncio.Queue[Indexed | BaseException | None] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for o in gen:
                queue.put_nowait((i, o))
        except Exception as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    tasks: list[asyncio.Task[None]] = []
    try:
        first = await anext(gens[0])
        yield 0, first
        running = len(gens)
        if first.finished:
            running -= 1
        else:
            tasks.append(asyncio.ensure_future(pump(0, gens[0])))
        tasks += [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens) if i]
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for g in gens:
            with contextlib.suppress(Exception):
                await g.aclose()  # type: ignore[attr-defined]


async def _single(gen: AsyncIterator[RequestOutput]) -> AsyncIterator[Indexed]:
    try:
        async for o in gen:
            yield 0, o
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


class CompletionGenerator:
    """One request's ``n`` samples on the engine, rendered as an OpenAI answer (text or chat):
    a whole body, or the SSE chunks of a stream."""

    def __init__(self, engine: AsyncLLM, tokenizer: Tokenizer, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.think_end_id = tokenizer.token_id(THINK_CLOSE)

    def _reasoning_tokens(
        self, outs: list[ChoiceOutput], token_ids: list[list[int]], spec: OutputSpec | None
    ) -> int | None:
        if spec is None:
            return None
        encode = self.tokenizer.encode
        return sum(
            o.reasoning_tokens(ids, self.think_end_id, encode)
            for o, ids in zip(outs, token_ids, strict=True)
        )

    async def completion(
        self,
        ids: list[int],
        params: SamplingParams,
        stream: bool,
        include_usage: bool,
        chat: bool,
        kv_transfer_params: PrefillRequestParams
        | RemotePrefillParams
        | PrefixPullParams
        | None = None,
        return_token_ids: bool = False,
        data_parallel_rank: int | None = None,
        n: int = 1,
        tokens_as_ids: bool = False,
        echo: str | None = None,
        traceparent: str | None = None,
        output: OutputSpec | None = None,
        continuation: Continuation | None = None,
    ) -> AsyncIterator[str] | dict[str, Any]:
        """``echo`` (completions): text put before each choice's (the prompt's). ``output``
        (chat): how each choice's text is parsed into reasoning, content and tool calls.
        ``continuation``: stream state, and the answer this one continues (n = 1)."""
        prefix = "chatcmpl" if chat else "cmpl"
        rid = self.engine.new_request_id(prefix)
        cont = continuation if continuation is not None and continuation.resumes else None
        resumed = resume_args(cont)
        gens = [
            self.engine.generate(
                ids,
                sample_params(params, i),
                rid if n == 1 else f"{rid}-{i}",
                kv_transfer_params,
                data_parallel_rank,
                traceparent,
                **resumed,
                movable=continuation is not None and stream and n == 1,
                collect=not stream,
            )
            for i in range(n)
        ]
        outputs = _single(gens[0]) if n == 1 else _merged(gens)
        created = int(time.time())
        if cont is not None:  # the answer's own id (tool-call ids derive from it) and time
            rid, created, echo = cont.response_id or rid, cont.created or created, None
        lps = [ChoiceLogprobs(self.tokenizer, chat, tokens_as_ids) for _ in range(n)]
        outs = [ChoiceOutput(output, rid, i) for i in range(n)]
        if cont is not None:
            sent = sent_text(self.tokenizer, cont, params.skip_special_tokens)
            prime(cont, sent, outs[0] if chat else None, lps[0])
        if stream:
            # pull the first increment now so a rejected request becomes an HTTP error, not a
            # broken stream
            try:
                first = await anext(outputs)
            except BaseException:
                await outputs.aclose()  # type: ignore[attr-defined]
                raise
            chats = outs if chat else None
            return self._stream(
                outputs,
                first,
                rid,
                created,
                lps,
                include_usage,
                chats,
                n,
                return_token_ids,
                echo,
                continuation,
            )
        text: list[list[str]] = [[echo] if echo else [] for _ in range(n)]
        logprobs: list[list[Any]] = [[] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        last: dict[int, RequestOutput] = {}
        async for i, o in outputs:
            text[i].append(o.delta_text)
            logprobs[i].extend(o.delta_logprobs or [])
            token_ids[i].extend(o.delta_token_ids)
            last[i] = o
        choices = []
        for i in range(n):
            choice: dict[str, Any] = {
                "index": i,
                "logprobs": lps[i].render(logprobs[i]) if params.logprobs is not None else None,
                "finish_reason": last[i].finish_reason,
                "stop_reason": last[i].stop_reason,
            }
            if chat:
                outs[i].feed("".join(text[i]))
                outs[i].finish(last[i].finish_reason)
                choice["message"] = outs[i].message()
                choice["finish_reason"] = outs[i].finish_reason(last[i].finish_reason)
            else:
                choice["text"] = "".join(text[i])
            if return_token_ids:  # vLLM's extension
                choice["token_ids"] = token_ids[i]
            choices.append(choice)
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(last, self._reasoning_tokens(outs, token_ids, output)),
        }
        if kv_transfer_params is not None:  # PD (vLLM's protocol): what the decode side needs
            kv = last[0].kv_transfer_params
            body["kv_transfer_params"] = kv.to_dict() if kv is not None else None
        return body

    async def _stream(
        self,
        outputs: AsyncIterator[Indexed],
        first: Indexed,
        rid: str,
        created: int,
        lps: list[ChoiceLogprobs],
        include_usage: bool,
        chats: list[ChoiceOutput] | None,
        n: int,
        return_token_ids: bool = False,
        echo: str | None = None,
        cont: Continuation | None = None,
    ) -> AsyncIterator[str]:
        """``chats``: each chat choice's parts (None: a completions stream). ``cont``: each
        increment followed by its stream-state block (``continuation``); resuming, no role
        chunk, and the tokens and text already sent count."""
        base = {
            "id": rid,
            "object": "chat.completion.chunk" if chats else "text_completion",
            "created": created,
            "model": self.model_name,
        }
        last: dict[int, RequestOutput] = {}
        token_ids: list[list[int]] = [[] for _ in range(n)]
        echoes = set(range(n)) if echo else set()  # the choices whose prompt is not sent yet
        state = StateWriter.of(cont, rid, created)
        if cont is not None:
            token_ids[0].extend(cont.token_ids)
        try:
            if chats and not (cont and cont.resumes):
                for i in range(n):
                    role = {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield state.wrap(_sse({**base, "choices": [role]}), [], "", False)
            item: Indexed | None = first
            while item is not None:
                i, o = item
                if o.finish_reason == "migrate":  # a drain: another engine continues it
                    kv = o.kv_transfer_params
                    yield state.migrated(kv.to_dict() if kv is not None else None)
                    return
                last[i] = o
                token_ids[i].extend(o.delta_token_ids)
                logprobs = lps[i].render(o.delta_logprobs)
                if chats:
                    choices = _chat_chunks(chats[i], i, o, logprobs, return_token_ids)
                else:
                    choice: dict[str, Any] = {
                        "index": i,
                        "logprobs": logprobs,
                        "finish_reason": o.finish_reason,
                        "text": (echo if echo and i in echoes else "") + o.delta_text,
                    }
                    if o.finished:
                        choice["stop_reason"] = o.stop_reason
                    if return_token_ids:
                        choice["token_ids"] = o.delta_token_ids
                    echoes.discard(i)
                    choices = [choice]
                events = "".join(_sse({**base, "choices": [c]}) for c in choices)
                events = state.wrap(events, o.delta_token_ids, o.delta_text, o.finished)
                if events:
                    yield events
                item = await anext(outputs, None)
            if include_usage:
                spec = chats[0].spec if chats else None
                reasoning = self._reasoning_tokens(chats or [], token_ids, spec)
                yield _sse({**base, "choices": [], "usage": _usage(last, reasoning)})
            yield "data: [DONE]\n\n"
        finally:
            # the client went away (or we are done): closing the outputs aborts the requests
            await outputs.aclose()  # type: ignore[attr-defined]


def _chat_chunks(
    out: ChoiceOutput, i: int, o: RequestOutput, logprobs: Any, return_token_ids: bool
) -> list[dict[str, Any]]:
    """The chunks of one increment of chat choice ``i``: one per delta (reasoning, content, a
    call's start, its arguments), the logprobs and token ids on the first, the finish reason on
    the last; one empty delta when the parser holds the text back but something must go out."""
    found = out.feed(o.delta_text)
    if o.finished:
        found += out.finish(o.finish_reason)
    carries = logprobs is not None or (return_token_ids and o.delta_token_ids)
    if not found and (o.finished or carries):
        found = [{}]
    chunks: list[dict[str, Any]] = [
        {"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in found
    ]
    if not chunks:
        return chunks
    chunks[0]["logprobs"] = logprobs
    if return_token_ids:
        chunks[0]["token_ids"] = o.delta_token_ids
        for c in chunks[1:]:
            c["token_ids"] = []
    if o.finished:
        chunks[-1]["finish_reason"] = out.finish_reason(o.finish_reason)
        chunks[-1]["stop_reason"] = o.stop_reason
    return chunks
