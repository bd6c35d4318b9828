"""``/v1/chat/completions`` (vLLM's ``OpenAIServingChat``): the messages through the model's
chat template."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from dsv4_serving.entrypoints.checks import BadRequest
from dsv4_serving.entrypoints.protocol import ChatCompletionRequest
from dsv4_serving.entrypoints.serving_engine import OpenAIServing


class OpenAIServingChat(OpenAIServing):
    chat = True
    prompt_param = "messages"

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request) -> Any:
        self.check_body(body)
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(msgs))
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from exc
        return await self.respond(request, body, ids)
