"""``/v1/chat/completions`` (vLLM's ``OpenAIServingChat``): the messages through the model's
chat format (``chat_prompt``: DeepSeek's encoder, or the tokenizer's Jinja template), each
choice's output parsed into reasoning, content and tool calls (``chat_output``)."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from dsv4_serving.engine.engine.async_llm import AsyncLLM
from dsv4_serving.engine.engine.tokenizer import Tokenizer
from dsv4_serving.entrypoints.chat_prompt import ChatRenderer, chat_format_of
from dsv4_serving.entrypoints.protocol import ChatCompletionRequest
from dsv4_serving.entrypoints.serving_engine import OpenAIServing


class OpenAIServingChat(OpenAIServing):
    chat = True
    prompt_param = "messages"

    def __init__(self, engine: AsyncLLM, tokenizer: Tokenizer, *rest: Any) -> None:
        super().__init__(engine, tokenizer, *rest)
        config = engine.config
        fmt = chat_format_of(config.model, config.chat_format)
        self.renderer = ChatRenderer(fmt, tokenizer, config.default_thinking == "on")

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request) -> Any:
        self.check_body(body)
        prompt = self.renderer.render(body)
        ids = self.tokenizer.encode(prompt.text)
        return await self.respond(request, body, ids, output=prompt.output)
