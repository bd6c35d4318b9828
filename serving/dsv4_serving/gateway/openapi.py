"""The gateway's OpenAPI document (``GET /openapi.json``): what it serves and answers, for
clients and for property-based tests (schemathesis). The request bodies are the OpenAI shapes
the gateway reads (``model``, ``prompt`` / ``messages``, ``stream``, ...); every other field
passes through to the engines, which check them (their own document is FastAPI's)."""

from __future__ import annotations

from typing import Any

_ERROR = {
    "description": "The OpenAI error body",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["message", "type"],
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]},
                        },
                    }
                },
            }
        }
    },
}
_ANSWER = {
    "description": "The engine's answer (JSON), or its server-sent events when streaming",
    "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
}
_COMMON: dict[str, Any] = {
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 4},
    "seed": {"type": ["integer", "null"], "minimum": 0},
    "stop": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array"}, {"type": "null"}]},
}
_PROMPT = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "integer", "minimum": 0}},
        {"type": "array", "items": {"type": "string"}},
    ]
}
_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "user", "assistant", "developer"]},
            "content": {"type": "string"},
        },
    },
}


def _generate(name: str, extra: dict[str, Any], required: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": name,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": [required],
                            "properties": {**_COMMON, **extra},
                        }
                    }
                },
            },
            "responses": {
                "200": _ANSWER,
                "400": _ERROR,
                "401": _ERROR,
                "429": _ERROR,
                "502": _ERROR,
                "503": _ERROR,
            },
        }
    }


def _get(summary: str, ok: dict[str, Any], unavailable: bool = False) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": ok}
    if unavailable:
        responses["503"] = {"description": "Not (or no longer) ready to serve"}
    return {"get": {"summary": summary, "responses": responses}}


def _json(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {}}}}


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "dsv4 gateway", "version": "1"},
        "paths": {
            "/v1/completions": _generate("Text completion", {"prompt": _PROMPT}, "prompt"),
            "/v1/chat/completions": _generate(
                "Chat completion", {"messages": _MESSAGES}, "messages"
            ),
            "/v1/models": _get("The served model", _json("An OpenAI model list"), True),
            "/health": _get("Liveness: an engine of each needed role", _json("ok"), True),
            "/ready": _get("Readiness: /health, and 503 while draining", _json("ok"), True),
            "/instances": _get("What the gateway routes to", _json("The instances")),
            "/metrics": _get(
                "Prometheus metrics",
                {"description": "Prometheus text", "content": {"text/plain": {}}},
            ),
        },
    }
