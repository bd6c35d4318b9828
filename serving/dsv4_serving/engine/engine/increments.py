"""A request's increments between the front end's output processing and its consumer (the
HTTP handler): a mailbox that coalesces. Each step puts one increment per request; a consumer
that is behind (a slow client, a busy event loop, a non-streamed answer that only collects)
takes everything that arrived since it last looked as one increment, so it wakes and writes
once per look, not once per token. Pure Python (asyncio only)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_serving.engine.request import Logprob


@dataclass(slots=True)
class RequestOutput:
    """One increment of a request, as the API layer streams it."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    delta_logprobs: list[Logprob] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: RemotePrefillParams | None = None  # a prefill's, for the remote decode


def coalesce(items: list[RequestOutput]) -> RequestOutput:
    """Consecutive increments of one request as one: the deltas joined, the rest the last's."""
    if len(items) == 1:
        return items[0]
    last = items[-1]
    logprobs = None
    if any(o.delta_logprobs is not None for o in items):
        logprobs = [lp for o in items for lp in o.delta_logprobs or ()]
    kv = next((o.kv_transfer_params for o in reversed(items) if o.kv_transfer_params), None)
    return RequestOutput(
        request_id=last.request_id,
        delta_text="".join(o.delta_text for o in items),
        delta_token_ids=[t for o in items for t in o.delta_token_ids],
        delta_logprobs=logprobs,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        finished=last.finished,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        kv_transfer_params=kv,
    )


class Mailbox:
    """Increments (or the error that ends the request) for one consumer task."""

    def __init__(self) -> None:
        self._items: list[RequestOutput | Exception] = []
        self._ready = asyncio.Event()
        self.puts = 0  # increments put (tests: how many a take coalesced)

    def put(self, item: RequestOutput | Exception) -> None:
        self._items.append(item)
        self.puts += 1
        self._ready.set()  # one wake-up for however many puts come before the consumer runs

    async def take(self) -> RequestOutput:
        """Everything put since the last take, as one increment; raises a put error once the
        increments before it were taken."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        outputs: list[RequestOutput] = []
        for i, item in enumerate(self._items):
            if isinstance(item, Exception):
                if outputs:  # the increments before the error first
                    self._items = self._items[i:]
                    return coalesce(outputs)
                self._items = self._items[i + 1 :]
                raise item
            outputs.append(item)
        self._items = []
        return coalesce(outputs)
