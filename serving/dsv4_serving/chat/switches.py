"""Request switches -> (thinking mode, effort tier), as a pure function of the request's fields.

Precedence: DeepSeek's ``thinking: {"type": ...}`` > vLLM's ``chat_template_kwargs``
(``thinking``, or ``enable_thinking``) > ``reasoning_effort: "none"`` > the server's default.
``reasoning_effort`` picks the tier of the checkpoint's effort table (DeepSeek's mapping):
minimal/low -> low, medium/high/xhigh -> high, max/ultra -> max; unset -> the table's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EFFORT_TIERS: dict[str, str | None] = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "high",
    "max": "max",
    "ultra": "max",
}


class ChatSwitchError(ValueError):
    """A switch with a bad value; ``field`` names it (the API answers 400 with ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class ChatSwitches:
    thinking: bool
    effort: str | None  # a tier ("low", "high", "max"); None: the table's default


def resolve_switches(
    *,
    thinking: Any = None,
    chat_template_kwargs: Any = None,
    reasoning_effort: Any = None,
    default_thinking: bool = True,
) -> ChatSwitches:
    """The mode and effort of one request; the arguments are the request's raw field values."""
    effort_on = _effort(reasoning_effort)
    mode = _thinking_field(thinking)
    if mode is None:
        mode = _kwargs_thinking(chat_template_kwargs)
    if mode is None and reasoning_effort == "none":
        mode = False
    if mode is None:
        mode = default_thinking
    return ChatSwitches(thinking=mode, effort=effort_on if mode else None)


def _effort(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in EFFORT_TIERS:
        choices = ", ".join(EFFORT_TIERS)
        raise ChatSwitchError("reasoning_effort", f"must be one of {choices}, not {value!r}")
    return EFFORT_TIERS[value]


def _thinking_field(value: Any) -> bool | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind not in ("enabled", "disabled"):
        raise ChatSwitchError(
            "thinking", f'must be {{"type": "enabled"}} or {{"type": "disabled"}}, not {value!r}'
        )
    return bool(kind == "enabled")


def _kwargs_thinking(kwargs: Any) -> bool | None:
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping):
        raise ChatSwitchError("chat_template_kwargs", "must be an object")
    found: dict[str, bool] = {}
    for key in ("thinking", "enable_thinking"):
        value = kwargs.get(key)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise ChatSwitchError(
                f"chat_template_kwargs.{key}", f"must be a boolean, not {value!r}"
            )
        found[key] = value
    if len(set(found.values())) > 1:
        raise ChatSwitchError(
            "chat_template_kwargs.enable_thinking", "contradicts chat_template_kwargs.thinking"
        )
    return next(iter(found.values()), None)
