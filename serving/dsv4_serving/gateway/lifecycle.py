"""One request's lifecycle at the gateway, with one owner: admission (the in-flight slot), the
latency timers and the upstream load and connection its answer holds are all released by
closing its ``Ticket``, exactly once.

The owner is ``Admission.admit``'s block in ``Gateway.handle``; a streamed answer takes the
ticket over (``Ticket.take_over``, an ``ExitStack.pop_all``) and its ``RelayResponse`` closes it
when the stream ends, fails or the client leaves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from types import TracebackType
from typing import Literal, TypeVar

from dsv4_serving.gateway.metrics import GatewayMetrics

T = TypeVar("T")

# the ``status`` label of dsv4_gateway_requests_total
Outcome = Literal["ok", "error", "cancelled", "rejected"]


_TEXT_KEYS = (b'"text":', b'"content":', b'"reasoning_content":')
_FINISHED = (b'"finish_reason": "', b'"finish_reason":"')


def carries_text(chunk: bytes) -> bool:
    """Whether a streamed chunk carries a generated token: a text, content or reasoning_content
    string that is non-empty, or empty in a choice not finished (a token whose bytes do not
    make a character yet). Not: a finish-only chunk, usage, [DONE]. A byte search, no parse,
    on the gateway's hot path; either JSON spacing."""
    empty = False
    for key in _TEXT_KEYS:
        i = chunk.find(key)
        while i >= 0:
            j = i + len(key)
            while chunk[j : j + 1] == b" ":
                j += 1
            if chunk[j : j + 1] == b'"':
                if chunk[j + 1 : j + 2] not in (b'"', b""):
                    return True
                empty = True
            i = chunk.find(key, j)
    return empty and not any(f in chunk for f in _FINISHED)


class Ticket:
    """An admitted request. ``outcome`` is set by whoever learns it (the proxy for a whole
    answer, the relay for a stream); left unset it counts as an error."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last_chunk: float | None = None
        self.outcome: Outcome | None = None
        self.closer = ExitStack()
        self.closer.push(self._record)

    def hold(self, resource: AbstractContextManager[T]) -> T:
        """Keep ``resource`` (an instance's load, an upstream response) until the ticket closes."""
        return self.closer.enter_context(resource)

    def take_over(self) -> ExitStack:
        """Move everything the ticket releases to a new owner; the old block then releases
        nothing. The new owner must close what it gets."""
        return self.closer.pop_all()

    def chunk(self, data: bytes) -> None:
        """A streamed chunk went to the client: TTFT for the first that carries text,
        inter-token latency after (a chunk of only a role, a finish reason, usage or [DONE]
        times no token, as in vLLM's own histograms and at the client)."""
        if not carries_text(data):
            return
        t = time.perf_counter()
        if self.last_chunk is None:
            self.metrics.ttft.observe(t - self.start)
        else:
            self.metrics.itl.observe(t - self.last_chunk)
        self.last_chunk = t

    def _record(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None and self.outcome is None:
            cancelled = issubclass(exc_type, asyncio.CancelledError)
            self.outcome = "cancelled" if cancelled else "error"
        outcome = self.outcome or "error"
        if outcome == "ok":
            self.metrics.e2e.observe(time.perf_counter() - self.start)
        self.metrics.outcome(outcome).inc()


class Admission:
    """The in-flight limit: a request past it is rejected, one within it gets a ticket."""

    def __init__(self, limit: int, metrics: GatewayMetrics) -> None:
        self.limit = limit
        self.metrics = metrics
        self.inflight = 0

    @property
    def full(self) -> bool:
        return self.inflight >= self.limit

    def reject(self) -> None:
        self.metrics.outcome("rejected").inc()

    @contextmanager
    def admit(self) -> Iterator[Ticket]:
        """A ticket holding one slot; the block's exit closes it unless it was taken over."""
        self._add(1)
        ticket = Ticket(self.metrics)
        # the stack unwinds in reverse: load and connections first, then the slot, then metrics
        ticket.closer.callback(self._add, -1)
        with ticket.closer:
            yield ticket

    def _add(self, n: int) -> None:
        self.inflight += n
        self.metrics.inflight.set(self.inflight)
