"""The output parser: known completions parsed whole and streamed cut at every boundary give the
same result; malformed calls stay content; render(assistant) -> parse gives the message back."""

# ruff: noqa: RUF001
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pytest

from dsv4_serving.chat import dsml, encoding_v4
from dsv4_serving.chat.output_parser import (
    Content,
    Event,
    OutputParser,
    ParsedMessage,
    Reasoning,
    ToolArgs,
    ToolCall,
    ToolStart,
    parse,
)

EOS = dsml.EOS
OPEN, CLOSE = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"


def inv(name: str, *params: str) -> str:
    return f'<｜DSML｜invoke name="{name}">\n' + "\n".join(params) + "\n</｜DSML｜invoke>"


def par(name: str, value: str, string: bool = True) -> str:
    flag = "true" if string else "false"
    return f'<｜DSML｜parameter name="{name}" string="{flag}">{value}</｜DSML｜parameter>'


def block(*invokes: str) -> str:
    return f"{OPEN}\n" + "\n".join(invokes) + f"\n{CLOSE}"


CITY = inv("get_weather", par("city", "Paris"))
TRICKY = inv(
    "write",
    par("path", "a<b>.txt"),
    par("text", 'line1\n</｜DSML｜param x="1"> "q" é 🙂\n\n'),
    par("opts", '{"n": [1, {"k": "}"}], "b": null}', string=False),
    par("count", "7", string=False),
)

# (name, text, thinking, expected reasoning, content, [(name, arguments as JSON value)])
CASES: list[tuple[str, str, bool, str, str, list[tuple[str, Any]]]] = [
    (
        "plain",
        f"Let me think.</think>The answer is 4.{EOS}",
        True,
        "Let me think.",
        "The answer is 4.",
        [],
    ),
    (
        "markup in content",
        "r</think>a < b\n\nc ≠ d 🙂 <b>x</b>\n",
        True,
        "r",
        "a < b\n\nc ≠ d 🙂 <b>x</b>\n",
        [],
    ),
    ("chat mode", f"Hello\n\nworld{EOS}", False, "", "Hello\n\nworld", []),
    (
        "one call",
        f"need it</think>Sure.\n\n{block(CITY)}{EOS}",
        True,
        "need it",
        "Sure.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "three calls",
        f"</think>\n\n{block(CITY, TRICKY, inv('noargs'))}{EOS}",
        True,
        "",
        "",
        [
            ("get_weather", {"city": "Paris"}),
            (
                "write",
                {
                    "path": "a<b>.txt",
                    "text": 'line1\n</｜DSML｜param x="1"> "q" é 🙂\n\n',
                    "opts": {"n": [1, {"k": "}"}], "b": None},
                    "count": 7,
                },
            ),
            ("noargs", {}),
        ],
    ),
    (
        "no blank line before the block",
        f"r</think>ok{block(CITY)}",
        True,
        "r",
        "ok",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "block opened inside reasoning",
        f"thinking...\n\n{block(CITY)}{EOS}",
        True,
        "thinking...",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "content after a block",
        f"</think>{block(CITY)}\nmore",
        True,
        "",
        "\nmore",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "bare word flagged non-string",
        f"{block(inv('f', par('x', 'abc', string=False)))}",
        False,
        "",
        "",
        [("f", {"x": "abc"})],
    ),
]


def merged(events: Iterable[Event]) -> list[Event]:
    """Events with adjacent text of one kind joined: the cut-independent view of a stream."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Reasoning | Content) and type(last) is type(e):
            out[-1] = type(e)(last.text + e.text)  # type: ignore[union-attr]
        elif isinstance(e, ToolArgs) and isinstance(last, ToolArgs) and last.index == e.index:
            out[-1] = ToolArgs(e.index, last.text + e.text)
        else:
            out.append(e)
    return out


def stream(
    pieces: Iterable[str], reason: str = "stop", **kw: Any
) -> tuple[ParsedMessage, list[Event]]:
    p = OutputParser(new_id=lambda i: f"call_{i}", **kw)
    events: list[Event] = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish(reason)
    return p.result, merged(events)


def calls_of(result: ParsedMessage) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


@pytest.mark.parametrize(("name", "text", "thinking", "reasoning", "content", "calls"), CASES)
def test_whole_text(
    name: str, text: str, thinking: bool, reasoning: str, content: str, calls: list[Any]
) -> None:
    got = parse(text, thinking=thinking)
    assert (got.reasoning, got.content, calls_of(got)) == (reasoning, content, calls)
    assert dsml.DSML not in got.content and dsml.DSML not in got.reasoning


@pytest.mark.parametrize(("name", "text", "thinking"), [c[:3] for c in CASES])
def test_every_two_way_cut_and_per_character(name: str, text: str, thinking: bool) -> None:
    want = stream([text], thinking=thinking)
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]], thinking=thinking) == want, i
    assert stream(list(text), thinking=thinking) == want


@pytest.mark.parametrize(
    "text",
    [
        f"a</think>b\n\n{OPEN}\n{inv('f', par('k', 'v'))}\n{CLOSE}",
        "x\n\n</think>\n\ny<｜DSML｜tool",
        "r</think>" + EOS,
    ],
)
def test_every_three_way_cut_of_short_texts(text: str) -> None:
    want = stream([text], thinking=True)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert stream([text[:i], text[i:j], text[j:]], thinking=True) == want, (i, j)


def test_ids_are_made_once_per_call_and_the_first_event_names_it() -> None:
    _, events = stream([CASES[4][1]], thinking=True)
    starts = [e for e in events if isinstance(e, ToolStart)]
    assert [(s.index, s.id, s.name) for s in starts] == [
        (0, "call_0", "get_weather"),
        (1, "call_1", "write"),
        (2, "call_2", "noargs"),
    ]
    ids = [c.id for c in parse(CASES[4][1], thinking=True).tool_calls]
    assert len(set(ids)) == 3 and all(i.startswith("call_") and len(i) == 29 for i in ids)


GOOD = inv("f", par("a", "1"))
MALFORMED = [
    (
        "no string attribute",
        f'ok\n\n{OPEN}\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n{CLOSE}',
    ),
    ("junk in the block", f"ok\n\n{OPEN}\nhello{CLOSE}"),
    ("duplicate parameter", f"ok\n\n{block(inv('f', par('a', '1'), par('a', '2')))}"),
    ("stopped inside a call", f"ok\n\n{OPEN}\n{GOOD[:40]}"),
]


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_a_malformed_call_stays_content(name: str, text: str) -> None:
    got = parse(text, thinking=False)
    assert got.tool_calls == [] and got.content == text
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]], thinking=False)[0].content == text


def test_an_unknown_tool_stays_content_when_names_are_given() -> None:
    text = f"{block(GOOD)}"
    assert parse(text, thinking=False, tool_names={"g"}).content == text
    assert len(parse(text, thinking=False, tool_names={"f"}).tool_calls) == 1


def test_calls_before_a_malformed_one_are_kept() -> None:
    bad = '<｜DSML｜invoke name="g">\noops\n</｜DSML｜invoke>'
    text = f"{OPEN}\n{GOOD}\n{bad}\n{CLOSE}"
    got = parse(text, thinking=False)
    assert [c.name for c in got.tool_calls] == ["f"]
    assert got.content == f"{bad}\n{CLOSE}"


def test_truncation_anywhere_never_raises_and_length_drops_the_partial_call() -> None:
    text = CASES[4][1]
    for i in range(len(text) + 1):
        for reason in ("length", "stop"):
            got, _ = stream([text[:i]], reason, thinking=True)
            done = text[:i].count("</｜DSML｜invoke>")
            assert len(got.tool_calls) == done
            if reason == "length" and OPEN in text[:i]:
                assert dsml.DSML not in got.content, i


def test_text_after_the_end_of_sentence_is_ignored() -> None:
    assert parse(f"</think>a{EOS}junk", thinking=True) == ParsedMessage("", "a", [])


ROUND_TRIP: list[dict[str, Any]] = [
    {"reasoning_content": "why", "content": "Because.", "tool_calls": []},
    {"reasoning_content": "", "content": "", "tool_calls": [("get_weather", {"city": "Paris"})]},
    {
        "reasoning_content": "r\n\nr",
        "content": "Let me check <x>.",
        "tool_calls": [
            ("f", {"s": 'é\n"q"', "n": 1.5, "l": [1, None], "o": {"a": {}}, "b": False}),
            ("g", {}),
        ],
    },
]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("msg", ROUND_TRIP)
def test_render_then_parse_gives_the_message_back(msg: dict[str, Any], thinking: bool) -> None:
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(msg["tool_calls"])
    ]
    text = encoding_v4.render_assistant({**msg, "tool_calls": calls}, "m", thinking)
    got = parse(text, thinking=thinking)
    assert got.reasoning == (msg["reasoning_content"] if thinking else "")
    assert got.content == msg["content"]
    assert calls_of(got) == msg["tool_calls"]
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]], thinking=thinking)[0].content == got.content


def test_v32_block_name() -> None:
    text = f"r</think>\n\n<｜DSML｜function_calls>\n{GOOD}\n</｜DSML｜function_calls>{EOS}"
    got = parse(text, thinking=True, block=dsml.V32_BLOCK)
    assert got.tool_calls == [ToolCall(got.tool_calls[0].id, "f", '{"a": "1"}')]
    assert got.content == ""


def test_calls_off_parses_reasoning_and_leaves_a_block_as_content() -> None:
    text = "r</think>c\n\n" + block(inv("f", par("a", "1"))) + EOS
    parser = OutputParser(thinking=True, calls=False)
    for ch in text:  # cut per character: nothing held back forever
        parser.feed(ch)
    parser.finish("stop")
    got = parser.result
    assert (got.reasoning, got.tool_calls) == ("r", [])
    assert got.content == "c\n\n" + block(inv("f", par("a", "1")))
