"""``/v1/models`` (vLLM's ``OpenAIServingModels``): the one model this server serves."""

from __future__ import annotations

import time
from typing import Any

from dsv4_serving.engine.engine.async_llm import AsyncLLM


class OpenAIServingModels:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        info = engine.info
        assert info is not None
        self.model_name = model_name
        self.root = engine.config.model
        self.max_model_len = info.max_model_len
        self.started = time.time()

    def show_available_models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": int(self.started),
                    "owned_by": "dsv4",
                    "root": self.root,
                    "max_model_len": self.max_model_len,
                }
            ],
        }
