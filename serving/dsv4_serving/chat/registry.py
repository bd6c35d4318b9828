"""Chat formats, chosen per model the way architectures are (``models/registry.py``).

A checkpoint's ``model_type`` (then its ``architectures``) picks DeepSeek's own format for V4 and
V3.2; every other model uses its tokenizer's Jinja ``chat_template``, which the engine renders
(the ``jinja`` format carries no encoder here, so this package needs no tokenizer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dsv4_serving.chat import dsml, encoding_v4, encoding_v32
from dsv4_serving.chat.effort import EffortTable
from dsv4_serving.chat.messages import EncodeOptions, Message
from dsv4_serving.chat.output_parser import OutputParser
from dsv4_serving.chat.tool_ids import random_tool_call_id

Encoder = Callable[[Sequence[Message], EncodeOptions], str]


class UnknownChatFormatError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """``encode`` is None for ``jinja`` (the engine's tokenizer renders it); ``call_block`` names
    the DSML block of calls the output parser looks for (None: no reasoning or call parsing)."""

    name: str
    encode: Encoder | None
    call_block: str | None

    @property
    def is_jinja(self) -> bool:
        return self.encode is None

    def with_effort_table(self, table: EffortTable) -> ChatFormat:
        """This format with a checkpoint's own effort prompts (V4 only)."""
        if self.name != DEEPSEEK_V4.name:
            return self
        return replace(self, encode=functools.partial(encoding_v4.encode, effort_table=table))

    def parser(
        self,
        *,
        thinking: bool,
        tool_names: Collection[str] | None = None,
        new_id: Callable[[int], str] = random_tool_call_id,
        calls: bool = True,
    ) -> OutputParser | None:
        if self.call_block is None:
            return None
        return OutputParser(
            thinking=thinking,
            block=self.call_block,
            tool_names=tool_names,
            new_id=new_id,
            calls=calls,
        )


JINJA = ChatFormat("jinja", None, None)
DEEPSEEK_V4 = ChatFormat("deepseek_v4", encoding_v4.encode, dsml.V4_BLOCK)
DEEPSEEK_V32 = ChatFormat("deepseek_v32", encoding_v32.encode, dsml.V32_BLOCK)

FORMATS: dict[str, ChatFormat] = {f.name: f for f in (JINJA, DEEPSEEK_V4, DEEPSEEK_V32)}
_BY_MODEL_TYPE = {"deepseek_v4": DEEPSEEK_V4, "deepseek_v32": DEEPSEEK_V32}
_BY_ARCHITECTURE = {
    "DeepseekV4ForCausalLM": DEEPSEEK_V4,
    "DeepseekV32ForCausalLM": DEEPSEEK_V32,
}


def chat_format_for(config: Mapping[str, Any]) -> ChatFormat:
    """The format of a checkpoint, from its ``config.json`` (as a mapping)."""
    found = _BY_MODEL_TYPE.get(str(config.get("model_type", "")))
    if found is not None:
        return found
    for arch in config.get("architectures") or ():
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    return JINJA


def chat_format_named(name: str) -> ChatFormat:
    """A format by name (a ``--chat-format`` override)."""
    try:
        return FORMATS[name]
    except KeyError:
        known = ", ".join(sorted(FORMATS))
        raise UnknownChatFormatError(f"unknown chat format {name!r} (known: {known})") from None
