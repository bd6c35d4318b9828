"""Structured outputs and an agent loop through `dsv4 up`'s default stack (PD over tcp, the
tiny model's MTP on) with a TP 2 prefill: every schema of the corpus gives JSON that validates
and equals one engine's greedy answer; openai-agents completes call, tool result, answer."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from dsv4_common.process import Service
from dsv4_serving.chat import dsml
from dsv4_serving.structured.schema_corpus import schemas
from tests.gateway.conftest import engine, running
from tests.gateway.test_gateway_pd import Up, up_running
from tests.structured_requests import (
    NO_THINKING,
    TOOLS,
    agent_three_turns,
    ask_json,
    assert_three_turns,
    client,
)

CORPUS = schemas()
MODEL = "dsv4-tiny"


@pytest.fixture(scope="module")
def stacks() -> Iterator[tuple[Up, Service]]:
    """(`dsv4 up` with a TP 2 prefill, one engine doing both: the greedy reference)."""
    with (
        running(engine("structured-up-reference"), timeout_s=600) as (ref,),
        up_running(
            "--prefill-arg=--tensor-parallel-size=2", "--startup-timeout", "600", timeout_s=660
        ) as up,
    ):
        yield up, ref


def _answers(url: str) -> list[Any]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda c: ask_json(url, MODEL, c, NO_THINKING), CORPUS))


def _tree(pid: int) -> dict[int, str]:
    """pid -> command line of ``pid`` and every descendant (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    tree, todo = {}, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            tree[p] = (Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")).decode()
        todo += [c for c, parent in parents.items() if parent == p]
    return tree


def test_the_stack_is_pd_with_a_tp2_prefill(stacks: tuple[Up, Service]) -> None:
    up, _ = stacks
    roles = sorted(i["role"] for i in httpx.get(f"{up.url}/instances", timeout=10).json())
    assert roles == ["decode", "prefill"]
    assert up.pid is not None
    engines = [c for c in _tree(up.pid).values() if " engine " in c and "--role" in c]
    tp2 = [c for c in engines if "--tensor-parallel-size=2" in c]
    assert len(tp2) == 1 and "prefill" in tp2[0], engines


def test_every_schema_validates_and_equals_one_engine(stacks: tuple[Up, Service]) -> None:
    up, ref = stacks
    assert len(CORPUS) >= 20
    through_pd, alone = _answers(up.url), _answers(ref.url)
    for case, pd, one in zip(CORPUS, through_pd, alone, strict=True):
        assert pd.finish_reason == "stop", (case["name"], pd.message.content)
        value = json.loads(pd.message.content)
        jsonschema.validate(value, case["schema"], format_checker=jsonschema.FormatChecker())
        assert pd.message.content == one.message.content, case["name"]


def test_an_agent_loop_through_the_stack(stacks: tuple[Up, Service]) -> None:
    up, _ = stacks
    assert_three_turns(*agent_three_turns(up.url, MODEL))


def test_auto_returns_tool_calls_when_the_model_writes_one(stacks: tuple[Up, Service]) -> None:
    """``tool_choice: auto`` with an answer that holds a call: the random-weight model is
    teacher-forced to write one through vLLM's ``structured_outputs`` (a choice of one text),
    and the parser returns it as ``tool_calls``."""
    up, _ = stacks
    call = dsml.render_block(
        dsml.V4_BLOCK, [dsml.render_invoke("weather", {"city": "Paris", "days": 3})]
    )
    r = client(up.url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="auto",
        temperature=0,
        max_tokens=200,
        extra_body={**NO_THINKING, "structured_outputs": {"choice": ["Checking.\n\n" + call]}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content == "Checking."
    (got,) = choice.message.tool_calls or []
    assert got.id.startswith("call_") and got.function.name == "weather"  # type: ignore[union-attr]
    assert json.loads(got.function.arguments) == {"city": "Paris", "days": 3}  # type: ignore[union-attr]
