"""``n`` > 1 under PD: one request becomes ``n`` PD requests of ``n = 1``, merged into one answer.

An engine refuses ``n`` > 1 with ``kv_transfer_params``, and an export is freed by its first
pull (the puller's RELEASE), so ``n`` decodes cannot share one prefill's KV. Choice ``i`` is a
whole PD request of its own instead: choice 0's prefill runs alone first, then the other
prefills run and find the prompt's full blocks in the prefill engine's prefix cache (the
routing policy sends them where the prompt is cached), as an engine's own ``n`` > 1 does.

Choice ``i`` is what one engine gives for its choice ``i``: with a ``seed``, it gets
``(seed + i) % 2**63``, the engine's rule (``entrypoints/serving.py``); without one it is
greedy or unseeded as the client asked. Answers merge as OpenAI's do: choices indexed
0..n-1, ``prompt_tokens`` once, ``completion_tokens`` summed. Streams interleave as they come,
each chunk with its choice's ``index`` and the first stream's ``id``; one usage chunk (when
``stream_options.include_usage``) and one ``[DONE]`` at the end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response

from dsv4_serving.gateway.lifecycle import Ticket
from dsv4_serving.gateway.proxy import RelayResponse
from dsv4_serving.http.errors import error_response

Chunk = str | bytes | memoryview  # what a StreamingResponse's body iterator gives
MAX_N = 128
"""OpenAI's limit on ``n``: each choice is a PD request of its own."""

# a choice's PD request: its body, and what to call once its prefill answered -> its answer
RunChoice = Callable[[dict[str, Any], Callable[[], None]], Awaitable[Response]]


def fan_out_n(body: dict[str, Any]) -> int:
    """The ``n`` to fan out (1: none; a malformed ``n`` goes to the engine, which names it)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def choice_bodies(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Choice ``i``'s request: ``n = 1`` and, with a seed, the engine's seed for sample ``i``."""
    seed = body.get("seed")
    out = []
    for i in range(n):
        b = {**body, "n": 1}
        if isinstance(seed, int) and not isinstance(seed, bool) and i:
            b["seed"] = (seed + i) % 2**63
        out.append(b)
    return out


def merge_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """One prompt, ``n`` completions: the prompt counted once, completions summed (their
    details too); cached tokens: the most any choice found cached (the engine's rule)."""
    out = dict(usages[0])
    prompt = int(out.get("prompt_tokens") or 0)
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
    out.update(completion_tokens=completion, total_tokens=prompt + completion)
    cached = [u.get("prompt_tokens_details") or {} for u in usages]
    if any(cached):
        out["prompt_tokens_details"] = {
            **cached[0],
            "cached_tokens": max(int(c.get("cached_tokens") or 0) for c in cached),
        }
    details = [u.get("completion_tokens_details") or {} for u in usages]
    if any(details):
        keys = dict.fromkeys(k for d in details for k in d)
        out["completion_tokens_details"] = {
            k: sum(int(d.get(k) or 0) for d in details) for k in keys
        }
    return out


def merge_answers(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """``n`` answers of one choice each as one answer of ``n`` choices."""
    out = dict(answers[0])
    choices = []
    for i, a in enumerate(answers):
        for c in a.get("choices") or []:
            choices.append({**c, "index": i})
    out["choices"] = choices
    usages = [a["usage"] for a in answers if isinstance(a.get("usage"), dict)]
    if len(usages) == len(answers):
        out["usage"] = merge_usage(usages)
    return out


async def fan_out(
    n: int, body: dict[str, Any], run: RunChoice, ticket: Ticket, request_id: str
) -> Response:
    """Run the ``n`` choices' PD requests (``run``) and merge their answers. Choice 0 starts
    alone; the others once its prefill answered (the prompt is cached then). A choice that
    fails fails the request (the first failed answer, by index, is the client's)."""
    if n > MAX_N:
        return error_response(400, f"n must be <= {MAX_N}, got {n}", param="n")
    bodies = choice_bodies(body, n)
    prefilled = asyncio.Event()
    tasks = [asyncio.ensure_future(run(bodies[0], prefilled.set))]
    try:
        waiter = asyncio.ensure_future(prefilled.wait())
        await asyncio.wait([tasks[0], waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not prefilled.is_set():  # choice 0's prefill failed: so would the others'
            return await tasks[0]
        tasks += [asyncio.ensure_future(run(b, lambda: None)) for b in bodies[1:]]
        answers = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    return _merged_response(answers, body, ticket, request_id)


def _merged_response(
    answers: list[Response], body: dict[str, Any], ticket: Ticket, request_id: str
) -> Response:
    failed = next((a for a in answers if a.status_code != 200), None)
    if failed is not None:
        ticket.outcome = "error"
        return failed
    headers = {"x-request-id": request_id}
    relays = [a for a in answers if isinstance(a, RelayResponse)]
    if len(relays) == len(answers):
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        merged = merge_streams([a.body_iterator for a in relays], include_usage, ticket)
        headers["cache-control"] = "no-cache"
        return RelayResponse(merged, ticket, media_type="text/event-stream", headers=headers)
    try:
        merged_answer = merge_answers([json.loads(bytes(a.body)) for a in answers])
    except (ValueError, TypeError, AttributeError) as e:
        ticket.outcome = "error"
        return error_response(
            502, f"a choice's answer is not a JSON object: {e}", code="upstream_error"
        )
    ticket.outcome = "ok"
    return Response(
        json.dumps(merged_answer, ensure_ascii=False),
        media_type="application/json",
        headers=headers,
    )


class StreamMerger:
    """The ``n`` choices' server-sent events as one stream: each event re-indexed to its
    choice and given the first stream's ``id`` and ``created``; their usage chunks and
    ``[DONE]`` held back for one of each at the end. Events may arrive split over chunks."""

    def __init__(self, n: int, include_usage: bool) -> None:
        self.include_usage = include_usage
        self._pending = [b""] * n
        self._usage: dict[int, dict[str, Any]] = {}
        self._usage_chunk: dict[str, Any] | None = None
        self._head: dict[str, Any] = {}  # id and created, from the first event
        self.errored = False

    def feed(self, i: int, chunk: bytes) -> bytes:
        """What to send for choice ``i``'s ``chunk`` (complete events only)."""
        data = self._pending[i] + chunk
        *events, self._pending[i] = data.replace(b"\r\n", b"\n").split(b"\n\n")
        return b"".join(self._event(i, e) for e in events)

    def _event(self, i: int, event: bytes) -> bytes:
        event = event.strip()
        if not event.startswith(b"data:"):
            return b""  # blank, or an SSE comment
        payload = event[5:].strip()
        if payload == b"[DONE]":
            return b""
        try:
            obj = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict) or "error" in obj:
            self.errored = True
            return event + b"\n\n"
        for key in ("id", "created"):
            if key in obj:
                obj[key] = self._head.setdefault(key, obj[key])
        choices = obj.get("choices")
        if not choices and isinstance(obj.get("usage"), dict):
            self._usage[i], self._usage_chunk = obj["usage"], obj
            return b""
        for c in choices or []:
            c["index"] = i
        if obj.get("usage") is not None:  # per-chunk usage: only the merged one, at the end
            obj["usage"] = None
        return _sse(obj)

    def finish(self) -> bytes:
        """The usage chunk (asked for, and every choice gave one) and ``[DONE]``."""
        out = b""
        every = self._usage_chunk is not None and len(self._usage) == len(self._pending)
        if self.include_usage and every:
            usage = merge_usage([self._usage[i] for i in sorted(self._usage)])
            chunk = {**(self._usage_chunk or {}), "usage": usage}
            out = _sse(chunk)
        return out + b"data: [DONE]\n\n"


async def merge_streams(
    streams: list[AsyncIterable[Chunk]], include_usage: bool, ticket: Ticket
) -> AsyncIterator[bytes]:
    """The streams' events interleaved as they come (``StreamMerger``). The ticket's outcome
    is the whole request's: ok once every stream ended well (each relay sets its own)."""
    queue: asyncio.Queue[tuple[int, bytes | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterable[Chunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk.encode() if isinstance(chunk, str) else bytes(chunk)))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    merger = StreamMerger(len(streams), include_usage)
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                live -= 1
                merger.errored |= ticket.outcome == "error"
                ticket.outcome = "cancelled"  # until every stream ended
                continue
            out = merger.feed(i, item)
            if out:
                yield out
        # set before the last bytes: the client may leave as soon as it has [DONE]
        ticket.outcome = "error" if merger.errored else "ok"
        yield merger.finish()
    finally:
        for t in tasks:
            t.cancel()


def _sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj``."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
