"""Completions and chat completions on top of ``AsyncLLM``: OpenAI response bodies, SSE
chunks, usage, logprobs."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from dsv4_kvtransfer.pd_protocol import PrefillRequestParams, RemotePrefillParams
from dsv4_serving.engine.async_llm import AsyncLLM, RequestOutput
from dsv4_serving.engine.request import Logprob
from dsv4_serving.engine.sampling_params import SamplingParams
from dsv4_serving.engine.tokenizer import Tokenizer


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(o: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": o.num_prompt_tokens,
        "completion_tokens": o.num_output_tokens,
        "total_tokens": o.num_prompt_tokens + o.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": o.num_cached_tokens},
    }


class _Logprobs:
    """Accumulates logprobs in the completions (legacy) or chat format."""

    def __init__(self, tok: Tokenizer, chat: bool) -> None:
        self.tok, self.chat = tok, chat
        self.items: list[Logprob] = []

    def _t(self, i: int) -> str:
        return self.tok.decode([i], skip_special_tokens=False)

    def render(self, lps: list[Logprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": self._t(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": list(self._t(lp.token_id).encode()),
                        "top_logprobs": [
                            {"token": self._t(t), "logprob": v, "bytes": list(self._t(t).encode())}
                            for t, v in lp.top
                        ],
                    }
                    for lp in lps
                ]
            }
        return {
            "tokens": [self._t(lp.token_id) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._t(t): v for t, v in lp.top} for lp in lps],
            "text_offset": [],
        }


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, tokenizer: Tokenizer, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name

    async def completion(
        self,
        ids: list[int],
        params: SamplingParams,
        stream: bool,
        include_usage: bool,
        chat: bool,
        kv_transfer_params: PrefillRequestParams | RemotePrefillParams | None = None,
        return_token_ids: bool = False,
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[str] | dict[str, Any]:
        prefix = "chatcmpl" if chat else "cmpl"
        rid = self.engine.new_request_id(prefix)
        gen = self.engine.generate(ids, params, rid, kv_transfer_params, data_parallel_rank)
        created = int(time.time())
        lp = _Logprobs(self.tokenizer, chat)
        if stream:
            # pull the first increment now so a rejected request becomes an HTTP error, not a
            # broken stream
            first = await gen.__anext__()
            return self._stream(gen, first, rid, created, lp, include_usage, chat, return_token_ids)
        text, lps, last, token_ids = [], [], None, []
        async for o in gen:
            text.append(o.delta_text)
            lps.extend(o.delta_logprobs or [])
            token_ids.extend(o.delta_token_ids)
            last = o
        assert last is not None
        logprobs = lp.render(lps) if params.logprobs is not None else None
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": logprobs,
            "finish_reason": last.finish_reason,
            "stop_reason": last.stop_reason,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        if return_token_ids:  # vLLM's extension
            choice["token_ids"] = token_ids
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(last),
        }
        if kv_transfer_params is not None:  # PD (vLLM's protocol): what the decode side needs
            kv = last.kv_transfer_params
            body["kv_transfer_params"] = kv.to_dict() if kv is not None else None
        return body

    async def _stream(
        self,
        gen: AsyncIterator[RequestOutput],
        first: RequestOutput,
        rid: str,
        created: int,
        lp: _Logprobs,
        include_usage: bool,
        chat: bool,
        return_token_ids: bool = False,
    ) -> AsyncIterator[str]:
        base = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
        }
        try:
            if chat:
                role = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _sse({**base, "choices": [role]})
            o: RequestOutput | None = first
            last = first
            while o is not None:
                last = o
                choice: dict[str, Any] = {
                    "index": 0,
                    "logprobs": lp.render(o.delta_logprobs),
                    "finish_reason": o.finish_reason,
                }
                if o.finished:
                    choice["stop_reason"] = o.stop_reason
                if chat:
                    choice["delta"] = {"content": o.delta_text}
                else:
                    choice["text"] = o.delta_text
                if return_token_ids:
                    choice["token_ids"] = o.delta_token_ids
                yield _sse({**base, "choices": [choice]})
                o = None if o.finished else await gen.__anext__()
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(last)})
            yield "data: [DONE]\n\n"
        finally:
            # the client went away (or we are done): closing the generator aborts the request
            await gen.aclose()  # type: ignore[attr-defined]
