"""``/v1/completions`` (vLLM's ``OpenAIServingCompletion``): one prompt, as text or token ids."""

from __future__ import annotations

from typing import Any, cast

from fastapi import Request

from dsv4_serving.entrypoints.checks import BadRequest
from dsv4_serving.entrypoints.protocol import CompletionRequest
from dsv4_serving.entrypoints.serving_engine import OpenAIServing


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, body: CompletionRequest, request: Request) -> Any:
        self.check_body(body)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise BadRequest("only one prompt per request is supported", param="prompt")
            p = p[0]
        # p is now one prompt: text or token ids (pydantic checked the shapes)
        ids = self.tokenizer.encode(p) if isinstance(p, str) else cast(list[int], list(p))
        echo = None
        if body.echo:  # vLLM's: the prompt as sent, or its ids' text
            echo = p if isinstance(p, str) else self.tokenizer.decode(ids)
        return await self.respond(request, body, ids, echo)
