"""What the client of one stream has received, kept from the engine's stream-state blocks
(``entrypoints/continuation.py``): the generated token ids, the characters of text sent, the
answer's ``id`` and ``created``, whether the choice finished and whether ``[DONE]`` went out.
Pure: bytes in, the bytes the client may have now out.

An engine asked for stream state (``continuation: {}``) follows each increment's events with a
comment block ``: dsv4 {...}``. The tracker passes events on only up to the last such block
(or ``[DONE]``), with the blocks removed, so the client always has whole increments and the
state says exactly which. A stream that does not open with a state block (another engine, or
an engine that was not asked) passes through as it comes and cannot be continued.
"""

from __future__ import annotations

import json
from typing import Any

STATE = b": dsv4 "
DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'
CONTINUABLE_ERRORS = frozenset({"engine_unavailable", "shutdown"})
"""Error codes an engine ends a started stream with when the engine, not the request, failed
(its core died, its shutdown grace ran out): the stream continues elsewhere."""

FIELD = "continuation"


class StreamState:
    """One stream's received state; ``feed`` the upstream's bytes as they come."""

    def __init__(self) -> None:
        self.tracked: bool | None = None  # None until the stream's first bytes are in
        self.token_ids: list[int] = []
        self.chars = 0
        self.response_id: str | None = None
        self.created: int | None = None
        self.finished = False
        self.done = False
        self.engine_error: bytes | None = None  # a continuable error event, held back
        # a drain moved the stream: the export of its KV (``kv_transfer_params``, None when
        # the engine has no KV sidecar or its export failed); the stream then ends
        self.moved: dict[str, Any] | None = None
        self._pending = b""  # complete events not yet relayed, then a partial one

    def feed(self, data: bytes) -> bytes:
        """``data`` from the upstream -> what the client may get now."""
        buf = self._pending + data if self._pending else data
        if self.tracked is None:
            if len(buf) < len(STATE):
                self._pending = buf
                return b""
            self.tracked = buf.startswith(STATE)
        if not self.tracked:
            self._pending = b""
            return buf
        out: list[bytes] = []
        held: list[bytes] = []
        start = 0
        while (end := buf.find(b"\n\n", start)) >= 0:
            block = buf[start : end + 2]
            start = end + 2
            if block.startswith(STATE):
                self._apply(json.loads(block[len(STATE) : -2]))
                out += held
                held = []
            elif block.startswith(DONE):
                out += held
                out.append(block)
                held = []
                self.done = True
            elif block.startswith(_ERROR) and _continuable(block):
                self.engine_error = block  # the relay continues the stream elsewhere
                break
            elif block.strip():
                held.append(block)
        self._pending = b"".join(held) + buf[start:]
        return b"".join(out)

    def _apply(self, state: dict[str, Any]) -> None:
        self.token_ids += state["t"]
        self.chars = state["c"]
        if state.get("f"):
            self.finished = True
        if "id" in state:
            self.response_id, self.created = state["id"], state["created"]
        if "m" in state:
            self.moved = state["m"] if isinstance(state["m"], dict) else {}

    def flush(self) -> bytes:
        """At the upstream's clean end: what an untracked stream still holds."""
        rest, self._pending = (b"", self._pending) if self.tracked else (self._pending, b"")
        return rest

    def drop_pending(self) -> None:
        """The upstream failed: what it sent after its last state block never happened."""
        self._pending = b""
        self.engine_error = None
        self.moved = None

    def continuable(self) -> bool:
        """Whether another engine can take the stream over from here."""
        return bool(self.tracked) and not self.done and not self.finished


def _continuable(block: bytes) -> bool:
    try:
        err = json.loads(block[len(b"data: ") :]).get("error") or {}
    except ValueError:
        return False
    return isinstance(err, dict) and err.get("code") in CONTINUABLE_ERRORS


def with_state(body: dict[str, Any]) -> dict[str, Any]:
    """The upstream body of a client's stream: stream state asked for (shallow copy)."""
    return {**body, FIELD: {}}


def continuation_body(body: dict[str, Any], state: StreamState) -> dict[str, Any]:
    """The upstream body that continues the stream where the client is: the client's request,
    the tokens it has and their text's length, the answer's id and created."""
    return {
        **body,
        FIELD: {
            "token_ids": list(state.token_ids),
            "chars": state.chars,
            "id": state.response_id,
            "created": state.created,
        },
    }


def moved_body(body: dict[str, Any], state: StreamState) -> dict[str, Any] | None:
    """The continuation of a stream a drain moved with its KV: ``continuation_body`` plus
    the export's ``kv_transfer_params`` (the continuing engine pulls the KV of every token but
    the last and computes that one); None when no KV came with it."""
    params = (state.moved or {}).get("kv_transfer_params")
    if not isinstance(params, dict):
        return None
    return {**continuation_body(body, state), "kv_transfer_params": params}


def wants_state(body: dict[str, Any]) -> bool:
    """A stream of one choice (n > 1 streams are not continued)."""
    n = body.get("n")
    return bool(body.get("stream")) and (n is None or n == 1)
