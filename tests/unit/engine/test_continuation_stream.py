"""A chat stream continued from any token (``entrypoints/continuation.py``), over a fake engine
that answers a fixed token stream: the first stream's events up to the cut, then the
continuation's, are exactly the uninterrupted stream's events (one role chunk, the same id,
created and tool-call ids, reasoning that goes on as reasoning, one usage counting every
token)."""

# DeepSeek's markers are spelled with U+FF5C
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dsv4_serving.engine.engine.async_llm import RequestOutput
from dsv4_serving.engine.engine.tokenizer import IncrementalDetokenizer
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.entrypoints.api_server import build_app
from dsv4_serving.entrypoints.metrics import EngineMetrics
from tests.unit.engine.test_chat_wiring import CALLED, MSG, TOK, TOOLS, ScriptedEngine

BODY = {
    "messages": MSG,
    "tools": TOOLS,
    "stream": True,
    "stream_options": {"include_usage": True},
    "continuation": {},
}


@dataclass
class ResumingEngine(ScriptedEngine):
    """The script one token per increment; a continuation gets the script past its tokens."""

    continued_with: list[list[int]] = field(default_factory=list)

    async def generate(  # type: ignore[override]
        self,
        ids: list[int],
        sp: SamplingParams,
        rid: str,
        *_: Any,
        continued: Sequence[int] = (),
        sent_chars: int = 0,
        movable: bool = False,
        collect: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        assert list(continued) == self.script[: len(continued)]
        self.continued_with.append(list(continued))
        detok = IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens)
        detok.add(list(continued), final=False)
        sent = sent_chars
        for k in range(len(continued), len(self.script)):
            final = k == len(self.script) - 1
            text = detok.add([self.script[k]], final)
            out = RequestOutput(rid, text[sent:], [self.script[k]], None, len(ids), k + 1)
            out.finished, out.finish_reason = final, "stop" if final else None
            sent = len(text)
            yield out


def _blocks(text: str) -> list[str]:
    return [b + "\n\n" for b in text.split("\n\n") if b]


def _state(block: str) -> dict[str, Any]:
    return json.loads(block[len(": dsv4 ") :])


@pytest.fixture(scope="module")
def served() -> tuple[TestClient, ResumingEngine]:
    engine = ResumingEngine(TOK)
    engine.script = TOK.encode(CALLED)
    app = build_app(engine, TOK, "m", EngineMetrics(engine))  # type: ignore[arg-type]
    return TestClient(app), engine


def test_a_continued_chat_stream_is_the_uninterrupted_one(
    served: tuple[TestClient, ResumingEngine],
) -> None:
    client, engine = served
    full = _blocks(client.post("/v1/chat/completions", json=BODY).text)
    head = _state(full[0])
    states = [i for i, b in enumerate(full) if b.startswith(": dsv4 ")][1:]
    data = [b for b in full if not b.startswith(": dsv4 ")]
    assert sum('"tool_calls"' in b for b in data) >= 2  # a call's start and its arguments
    assert any('"reasoning_content"' in b for b in data)
    n = len(engine.script)
    for cut in range(1, n):
        at = states[cut]  # the state block after the cut-th increment (the first is the role's)
        got = [b for b in full[:at] if not b.startswith(": dsv4 ")]
        sent = [t for b in full[: at + 1] if b.startswith(": dsv4 ") for t in _state(b)["t"]]
        assert sent == engine.script[:cut]
        cont = {"token_ids": sent, "chars": _state(full[at])["c"]}
        cont |= {"id": head["id"], "created": head["created"]}
        r = client.post("/v1/chat/completions", json={**BODY, "continuation": cont})
        assert r.status_code == 200, r.text
        rest = [b for b in _blocks(r.text) if not b.startswith(": dsv4 ")]
        assert got + rest == data, cut
    assert engine.continued_with[-1] == engine.script[: n - 1]
