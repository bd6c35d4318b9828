"""The gateway's per-stream received state (``gateway/stream_state.py``): what is relayed of
an engine's stream with state blocks, when, and the continuation request built from it."""

from __future__ import annotations

import json

from dsv4_serving.gateway.stream_state import (
    StreamState,
    continuation_body,
    wants_state,
    with_state,
)

HEAD = b': dsv4 {"t":[],"c":0,"id":"cmpl-1","created":7}\n\n'
A = b'data: {"choices":[{"text":"ab"}]}\n\n'
B = b'data: {"choices":[{"text":"c"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{}}\n\n'
DONE = b"data: [DONE]\n\n"


def _state(t: list[int], c: int, f: bool = False) -> bytes:
    s = {"t": t, "c": c} | ({"f": 1} if f else {})
    return b": dsv4 " + json.dumps(s, separators=(",", ":")).encode() + b"\n\n"


def test_whole_increments_go_out_with_their_state_and_without_it() -> None:
    s = StreamState()
    stream = HEAD + A + _state([10, 11], 2) + B + _state([12], 3, f=True) + USAGE + DONE
    assert s.feed(stream) == A + B + USAGE + DONE
    assert (s.tracked, s.token_ids, s.chars, s.finished, s.done) == (
        True,
        [10, 11, 12],
        3,
        True,
        True,
    )
    assert (s.response_id, s.created) == ("cmpl-1", 7)


def test_an_increment_is_held_until_its_state_block_is_in_whole() -> None:
    s = StreamState()
    stream = HEAD + A + _state([10, 11], 2) + B + _state([12], 3)
    cut = len(HEAD + A + _state([10, 11], 2) + B) + 5  # inside B's state block
    assert s.feed(b": ds") == b""  # not yet known whether the stream has state
    assert s.feed(stream[4:cut]) == A
    assert (s.token_ids, s.chars) == ([10, 11], 2)
    # the upstream breaks here: B never reached the client, and is forgotten
    s.drop_pending()
    assert s.continuable()
    assert s.feed(b"") == b""
    assert s.feed(B + _state([12], 3)) == B  # the continuation's bytes
    assert (s.token_ids, s.chars) == ([10, 11, 12], 3)


def test_a_comment_only_increment_moves_the_state() -> None:
    """The chat parser held the increment's text back: no event, the tokens still count."""
    s = StreamState()
    assert s.feed(HEAD + _state([5], 1) + _state([6], 4)) == b""
    assert (s.token_ids, s.chars) == ([5, 6], 4)


def test_a_stream_without_state_passes_through_and_cannot_continue() -> None:
    s = StreamState()
    assert s.feed(b"da") == b""
    assert s.feed(b"ta: {}\n\ndata: {") == b"data: {}\n\ndata: {"
    assert s.feed(b"}\n\n") == b"}\n\n"
    assert s.tracked is False and not s.continuable()
    short = StreamState()
    assert short.feed(b"data") == b""
    assert short.flush() == b"data"


def test_an_engine_failure_event_is_held_for_the_continuation() -> None:
    err = b'data: {"error": {"message": "core died", "code": "engine_unavailable"}}\n\n'
    s = StreamState()
    assert s.feed(HEAD + A + _state([1], 2) + err + DONE) == A
    assert s.engine_error == err and not s.done and s.continuable()
    bad = b'data: {"error": {"message": "bug", "code": "internal_error"}}\n\n'
    t = StreamState()
    assert t.feed(HEAD + bad + DONE) == bad + DONE  # not the engine's death: relayed
    assert t.engine_error is None and t.done


def test_a_finished_choice_is_not_continued() -> None:
    s = StreamState()
    s.feed(HEAD + A + _state([1, 2], 2, f=True) + USAGE)
    assert s.finished and not s.done and not s.continuable()


def test_the_continuation_request() -> None:
    body = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 9}
    assert wants_state(body) and wants_state({**body, "n": 1})
    assert not wants_state({**body, "n": 2}) and not wants_state({**body, "stream": False})
    assert with_state(body) == {**body, "continuation": {}}
    s = StreamState()
    s.feed(HEAD + A + _state([10, 11], 2))
    assert continuation_body(with_state(body), s) == {
        **body,
        "continuation": {"token_ids": [10, 11], "chars": 2, "id": "cmpl-1", "created": 7},
    }
    assert body == {"model": "m", "prompt": "p", "stream": True, "max_tokens": 9}
