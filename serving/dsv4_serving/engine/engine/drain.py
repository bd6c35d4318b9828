"""Drain by moving the KV: the core's half of ``POST /drain`` (``entrypoints/api_server.py``).

The front end names the requests to move (``MigrateRequests``: the streams a gateway can
continue). Each is moved at the first step boundary where it is *movable*: running, past its
first token, and with every token but the last sampled one forwarded (no step of it in
flight). It then leaves the batch (``Scheduler.migrate``): with a KV connector its blocks and
state slot are exported as a finished prefill's are (``kv_connector/scheduler_side.py``: the
KV of every token but the last, the prompt hash over all of them), and its last output, no
token and ``finish_reason`` "migrate", goes out with the export's ``kv_transfer_params`` once
the export ended (or its error: the stream is then recomputed elsewhere). Without a
connector it goes out at once, with no params.

Requests still prefilling go on until their first token, then move. Under async scheduling a
named request is kept out of the next schedule until its step in flight returned, so the KV
exported is exactly what the synchronous engine would have had.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from dsv4_serving.engine.core.sched.scheduler import Scheduler
from dsv4_serving.engine.request import Request, RequestStatus


def movable(req: Request) -> bool:
    """Whether ``req`` can leave now: decoding, nothing of it in flight."""
    return (
        req.status == RequestStatus.RUNNING
        and req.num_output_tokens > 0
        and req.num_output_placeholders == 0
        and req.num_computed_tokens == req.num_tokens - 1
    )


class Migrations:
    """The requests named to move that have not moved yet."""

    def __init__(self) -> None:
        self.pending: set[str] = set()

    def add(self, request_ids: Iterable[str]) -> None:
        self.pending.update(request_ids)

    def run(self, scheduler: Scheduler) -> int:
        """Move every named request that is movable now; forget those that finished. ->
        how many moved."""
        moved = 0
        for rid in sorted(self.pending):
            req = scheduler.requests.get(rid)
            if req is None:  # finished (or aborted) before it could move
                self.pending.discard(rid)
            elif movable(req):
                self.pending.discard(rid)
                scheduler.migrate(req)
                moved += 1
        return moved

    @contextlib.contextmanager
    def held_back(self, scheduler: Scheduler) -> Iterator[None]:
        """While scheduling: named requests past their first token whose step is in flight
        (async scheduling) get no further step, so they become movable when it returns."""
        if not self.pending:
            yield
            return
        held = [
            r
            for r in scheduler.running
            if r.request_id in self.pending and r.num_output_tokens and r.num_output_placeholders
        ]
        for r in held:
            scheduler.running.remove(r)
        try:
            yield
        finally:
            scheduler.running.extend(held)
