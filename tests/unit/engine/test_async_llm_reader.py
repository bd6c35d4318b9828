"""The front end's reader thread after the event loop ended: a core message that arrives
between the end of ``asyncio.run`` and ``shutdown`` is dropped quietly (no "Event loop is
closed" traceback), and a core death then still kills the other ranks."""

from __future__ import annotations

import asyncio
import queue
from typing import Any

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.async_llm import AsyncLLM


class OneMessage:
    """The core's output queue: one message, then the front end is shutting down."""

    def __init__(self, llm: AsyncLLM, msg: object) -> None:
        self.llm, self.msgs = llm, [msg]

    def get(self, timeout: float) -> object:
        if self.msgs:
            return self.msgs.pop()
        self.llm._closing = True
        raise queue.Empty


class Ranks:
    def __init__(self, dead: tuple[int, int] | None) -> None:
        self.dead, self.killed = dead, False
        self.procs = [None, None]

    def first_dead(self) -> tuple[int, int] | None:
        return self.dead

    def kill(self) -> None:
        self.killed = True


def closed_llm(dead: tuple[int, int] | None) -> AsyncLLM:
    llm = AsyncLLM(EngineConfig(model="dsv4-tiny"), None)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    loop.close()
    llm._loop = loop
    llm._ranks = Ranks(dead)  # type: ignore[assignment]
    llm._out = OneMessage(llm, object())
    return llm


def test_a_message_after_the_loop_closed_is_dropped_quietly() -> None:
    llm = closed_llm(None)
    llm._read()  # returns once closing: no RuntimeError
    out: Any = llm._out
    assert out.msgs == [] and llm._closing


def test_a_death_after_the_loop_closed_still_kills_the_other_ranks() -> None:
    llm = closed_llm((1, -9))
    llm._read()
    ranks: Any = llm._ranks
    assert ranks.killed
