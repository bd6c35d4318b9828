"""Every field of OpenAI's chat and completions requests is honoured, a documented no-op, or
refused with a 400 naming it: nothing a client sends vanishes without a word. Fields nobody
in OpenAI's API defines are ignored with a log line (``protocol``), as vLLM does.

``REFUSED`` holds, per field, the values that are fine (the harmless defaults) and why any
other is refused; ``NO_OPS`` the fields accepted and documented as doing nothing here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NO_OPS: frozenset[str] = frozenset(
    {
        "user",
        "metadata",
        "store",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "stream_options.include_obfuscation",
        "messages[].name",
        "messages[].refusal",
    }
)
"""Accepted, and doing nothing on this server. (``messages[].tool_call_id``,
``reasoning_content`` and ``reasoning`` are read by DeepSeek's chat format and ignored by a
Jinja template.)"""

INTERNAL: frozenset[str] = frozenset({"continuation"})
"""Fields the engine takes from the gateway only (the gateway refuses them from clients):
``continuation`` asks for stream state and continues an answer another engine started
(``entrypoints/continuation.py``)."""

_NOT_YET = "is not supported by this server yet"


def _function_tools(v: Any) -> bool:
    return not v or all(isinstance(t, dict) and t.get("type") == "function" for t in v)


@dataclass(frozen=True, slots=True)
class Refused:
    fine: Callable[[Any], bool]
    """The values that are harmless here (the field's default meaning)."""
    why: str


def _unset(v: Any) -> bool:
    return v is None


REFUSED_CHAT: dict[str, Refused] = {
    "tools": Refused(_function_tools, "tools of a type other than 'function' are not supported"),
    "functions": Refused(_unset, "functions is deprecated and not supported; use tools"),
    "function_call": Refused(_unset, "function_call is deprecated and not supported; use tools"),
    "audio": Refused(_unset, "audio output is not supported (this model writes text)"),
    "modalities": Refused(
        lambda v: v is None or v == ["text"], "modalities other than ['text'] are not supported"
    ),
    "prediction": Refused(_unset, "prediction (predicted outputs) is not supported"),
    "web_search_options": Refused(_unset, "web_search_options is not supported"),
    "service_tier": Refused(
        lambda v: v in (None, "auto", "default"),
        "service_tier other than 'auto' or 'default' is not supported",
    ),
    "verbosity": Refused(
        lambda v: v in (None, "medium"), "verbosity other than 'medium' is not supported"
    ),
    "moderation": Refused(_unset, "moderation is not supported"),
}
"""Chat request fields and the values refused (a 400 naming the field)."""

REFUSED_COMPLETION: dict[str, Refused] = {
    "suffix": Refused(lambda v: not v, "suffix (insertion) is not supported"),
    "best_of": Refused(lambda v: v in (None, 1), "best_of > 1 is not supported; use n"),
}
"""Completions request fields and the values refused."""

REFUSED_MESSAGE: dict[str, Refused] = {
    "function_call": Refused(_unset, "function_call is deprecated and not supported"),
    "audio": Refused(_unset, "audio is not supported (this model reads text)"),
    "prefix": Refused(lambda v: not v, f"prefix (assistant prefill) {_NOT_YET}"),
}
"""Fields of one chat message and the values refused."""


Refusal = tuple[str, str]
"""(the field, why it is refused): the API answers a 400 naming it."""


def refused(body: object, table: dict[str, Refused], prefix: str = "") -> Refusal | None:
    """The first field of ``body`` set to a value this server does not honour."""
    for name, rule in table.items():
        if not rule.fine(getattr(body, name, None)):
            return prefix + name, rule.why
    return None
