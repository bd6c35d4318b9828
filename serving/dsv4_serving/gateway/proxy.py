"""PD orchestration, per vLLM's protocol: prefill (max_tokens=1, do_remote_decode) on one
instance, then decode with the returned kv_transfer_params on another, streaming its answer.

Every upstream call has a timeout; a failed prefill is retried on another prefill instance, a
decode that fails before its first byte on another decode instance; upstream responses are
always closed (also when the client goes away, which aborts the engine's request). An engine
that answers 503 + X-DSV4-Draining is shutting down and did no work: the request goes to another
instance and the draining one gets no new requests (not counted as a failure).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack
from typing import Any

import aiohttp
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from dsv4_common import tracing
from dsv4_common.errors import openai_error
from dsv4_common.light_spans import Recorder, Span
from dsv4_kvtransfer.pd_protocol import (
    KV_TRANSFER_ERROR_TYPE,
    KVParamsError,
    decode_request,
    prefill_request,
)
from dsv4_serving.gateway.config import GatewayConfig
from dsv4_serving.gateway.health import mark_failure, mark_success
from dsv4_serving.gateway.instances import Instance, InstancePool, Role
from dsv4_serving.gateway.lifecycle import Ticket
from dsv4_serving.gateway.metrics import GatewayMetrics
from dsv4_serving.gateway.policies import Choice, Policy, RouteRequest, paired_revisions
from dsv4_serving.gateway.stream_state import StreamState, continuation_body, moved_body
from dsv4_serving.gateway.tracing import attempt_span, current_span, routing_under, upstream_status
from dsv4_serving.gateway.upstream import UpstreamClient, UpstreamError, UpstreamResponse
from dsv4_serving.http.errors import DRAINING_HEADER, error_response

log = logging.getLogger("dsv4.gateway")
Opened = tuple[UpstreamResponse, Instance, ExitStack]
"""An upstream answer below 500: the response, its instance, what its attempt holds."""
Resume = Callable[[dict[str, Any], set[str]], Awaitable[Opened]]
"""Open a stream's continuation (its body, the instances not to use)."""
_HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
}


class UpstreamFailed(Exception):
    """Every attempt of a stage failed; ``response`` is what the client gets."""

    def __init__(self, response: Response) -> None:
        super().__init__("upstream failed")
        self.response = response


def _client_response(resp: UpstreamResponse, content: bytes, request_id: str) -> Response:
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
    headers["x-request-id"] = request_id
    return Response(
        content=content,
        status_code=resp.status,
        headers=headers,
        media_type=resp.headers.get("content-type"),
    )


def _kv_transfer_error(content: bytes) -> bool:
    """Whether an engine's 5xx body is its KV-transfer error (the engine itself is fine)."""
    try:
        err = json.loads(content).get("error") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and err.get("type") == KV_TRANSFER_ERROR_TYPE


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """Our engines' params are checked strictly; another engine's (vLLM's) pass through as-is."""
    try:
        return decode_request(body, prefill_answer)
    except KVParamsError:
        params = prefill_answer.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            return {**body, "kv_transfer_params": params}
        raise


class Proxy:
    def __init__(
        self, cfg: GatewayConfig, pool: InstancePool, policy: Policy, metrics: GatewayMetrics
    ) -> None:
        self.cfg, self.pool, self.policy, self.metrics = cfg, pool, policy, metrics
        self.client: aiohttp.ClientSession | None = None
        self.tracer: Recorder | None = None  # tracing on: the gateway's spans (set by the app)
        # the engine calls themselves (health checks and scrapes use ``client``)
        self.upstream = UpstreamClient(cfg.connect_timeout_s)
        self._routed: dict[tuple[str, str], Any] = {}  # (role, url) -> its counter child

    # ---- routing -------------------------------------------------------------------------

    def _choose(self, role: Role, req: RouteRequest, exclude: set[str]) -> Choice | None:
        candidates = [i for i in self.pool.of_role(role) if i.url not in exclude]
        if role == "prefill":  # PD: within the best revision that has a decode to pair with
            revs = paired_revisions(
                candidates, self.pool.of_role("decode"), self.pool.newest_revision
            )
            if revs:  # none: the decode stage says which role is missing
                candidates = [i for i in candidates if i.revision == revs[0]]
        elif req.revision is not None:  # the decode of a prefill: its revision only
            candidates = [i for i in candidates if i.revision == req.revision]
        choice = self.policy.choose(candidates, req)
        if choice is not None and req.revision is not None:
            self.metrics.pd_pairs.labels(req.revision, choice.instance.revision).inc()
        return choice

    def _headers(self, request_id: str, choice: Choice, span: Span | None = None) -> dict[str, str]:
        h = {"x-request-id": request_id, "content-type": "application/json"}
        if span is not None:
            h[tracing.TRACEPARENT] = span.traceparent()
        if choice.instance.dp_size > 1:
            h["x-data-parallel-rank"] = str(choice.rank)  # vLLM's header for DP-rank routing
        return h

    def _fail(self, inst: Instance) -> None:
        mark_failure(inst, self.metrics, self.cfg.eject_after_failures)

    def _failed(self, inst: Instance, status: int, headers: Any) -> None:
        """A 5xx answer: a draining instance is set aside, anything else counts as a failure."""
        if status == 503 and headers.get(DRAINING_HEADER) == "1":
            if not inst.draining:
                log.info("%s (%s) is draining: no new requests", inst.url, inst.role)
            inst.draining = True
        else:
            self._fail(inst)

    def _attempts(self, role: Role, req: RouteRequest, tried: set[str]) -> Iterator[Choice]:
        """Up to 1 + retries choices of ``role``, never the same instance twice."""
        for attempt in range(self.cfg.retries + 1):
            choice = self._choose(role, req, tried)
            if choice is None:
                return
            tried.add(choice.instance.url)
            if attempt:
                self.metrics.retries.labels(role).inc()
            counter = self._routed.get((role, choice.instance.url))
            if counter is None:
                counter = self.metrics.routed.labels(role, choice.instance.url)
                self._routed[role, choice.instance.url] = counter
            counter.inc()
            yield choice

    @staticmethod
    def _exhausted(role: Role, tried: set[str], last: str, request_id: str) -> UpstreamFailed:
        """503 when no instance could be tried, 502 when every one tried failed."""
        headers = {"x-request-id": request_id}
        if not tried:
            return UpstreamFailed(
                error_response(
                    503, f"no healthy {role} instance", code="service_unavailable", headers=headers
                )
            )
        why = last or f"no {role} instance left that was not tried"
        return UpstreamFailed(error_response(502, why, code="upstream_error", headers=headers))

    # ---- stages --------------------------------------------------------------------------

    async def prefill(
        self, path: str, body: dict[str, Any], req: RouteRequest, request_id: str
    ) -> tuple[dict[str, Any], Instance]:
        """The prefill answer (JSON) and who gave it; retried on another instance on failure."""
        tried: set[str] = set()
        last = ""
        for choice in self._attempts("prefill", req, tried):
            inst = choice.instance
            try:
                with (
                    inst.held(choice.rank, req.prompt_tokens - choice.cached_tokens),
                    attempt_span(
                        self.tracer, "prefill", choice, len(tried) - 1, self.policy.name
                    ) as span,
                ):
                    async with asyncio.timeout(self.cfg.prefill_timeout_s):
                        resp = await self.upstream.post(
                            inst.url,
                            path,
                            json.dumps(prefill_request(body)).encode(),
                            self._headers(request_id, choice, span).items(),
                        )
                        try:
                            status, content = resp.status, await resp.read()
                        finally:
                            resp.close()
                    headers = resp.headers
                    upstream_status(span, status)
                    if status != 200 and status < 500:  # the request is bad: tell the client
                        raise UpstreamFailed(_client_response(resp, content, request_id))
            except (UpstreamError, TimeoutError) as e:
                self._fail(inst)
                last = f"prefill on {inst.url} failed: {type(e).__name__}: {e}"
                continue
            if status >= 500:
                self._failed(inst, status, headers)
                last = f"prefill on {inst.url} answered {status}: {content[:200]!r}"
                continue
            mark_success(inst)
            inst.prefix.add(req.block_hashes)
            try:
                answer = json.loads(content)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                last = f"prefill on {inst.url} answered something other than a JSON object"
                continue
            return answer, inst
        raise self._exhausted("prefill", tried, last, request_id)

    async def open(
        self,
        role: Role,
        path: str,
        body: dict[str, Any],
        req: RouteRequest,
        request_id: str,
        tried: set[str],
    ) -> Opened:
        """Send ``body`` to a ``role`` instance not in ``tried``, retried on another until one
        answers below 500: its response, instance and what the attempt holds (its load, its
        span, the response), for the caller to close."""
        last = ""
        for choice in self._attempts(role, req, tried):
            inst = choice.instance
            # what this attempt holds, released however it ends (error, retry, cancellation) ...
            with ExitStack() as attempt:
                attempt.enter_context(inst.held(choice.rank, req.prompt_tokens))
                span = attempt.enter_context(
                    attempt_span(self.tracer, role, choice, len(tried) - 1, self.policy.name)
                )
                try:
                    # asyncio.timeout, not wait_for: no task per call
                    async with asyncio.timeout(self.cfg.first_byte_timeout_s):
                        resp = await self.upstream.post(
                            inst.url,
                            path,
                            json.dumps(body).encode(),
                            self._headers(request_id, choice, span).items(),
                        )
                except (UpstreamError, TimeoutError) as e:
                    self._fail(inst)
                    last = f"{role} on {inst.url} failed: {type(e).__name__}: {e}"
                    if span is not None:
                        span.fail(last)
                    continue
                # a response dropped before its end closes the connection: the engine aborts
                attempt.callback(resp.close)
                upstream_status(span, resp.status)
                if resp.status >= 500:
                    try:
                        content = await resp.read(self.cfg.stream_idle_timeout_s)
                    except (UpstreamError, TimeoutError):
                        content = b""
                    if not _kv_transfer_error(content):
                        # a failed KV pull is usually the prefill side's fault: retry elsewhere
                        # (the export stays until its lease ends) without holding it against this one
                        self._failed(inst, resp.status, resp.headers)
                    last = f"{role} on {inst.url} answered {resp.status}: {content[:200]!r}"
                    continue
                mark_success(inst)
                if role != "decode":
                    inst.prefix.add(req.block_hashes)
                return resp, inst, attempt.pop_all()  # ... or by the caller
        raise self._exhausted(role, tried, last, request_id)

    async def forward(
        self,
        role: Role,
        path: str,
        body: dict[str, Any],
        req: RouteRequest,
        request_id: str,
        stream: bool,
        ticket: Ticket,
        resume: Resume | None = None,
    ) -> Response:
        """Send ``body`` to a ``role`` instance and relay its answer; retried on another instance
        until the first byte. A streamed answer leaves its load and connection with ``ticket``;
        one with stream state (``stream_state``) continues on another instance if its upstream
        fails (``resume``: how to open the continuation; by default another ``role`` instance)."""
        tried: set[str] = set()
        resp, inst, attempt = await self.open(role, path, body, req, request_id, tried)
        if stream and resp.status == 200:

            async def reopen(cont: dict[str, Any], tried: set[str]) -> Opened:
                return await self.open(role, path, cont, req, request_id, tried)

            relay = StreamRelay(self, body, resume or reopen, tried, ticket, current_span())
            relay.move = reopen  # a drained stream with its KV: straight to another ``role``
            ticket.hold(relay.attempts)  # ... or, streamed, when the stream ends
            relay.attempts.enter_context(attempt)
            return RelayResponse(
                relay.chunks(resp, inst),
                ticket,
                status_code=200,
                media_type=resp.headers.get("content-type", "text/event-stream"),
                headers={"x-request-id": request_id, "cache-control": "no-cache"},
            )
        with attempt:
            try:
                content = await resp.read(self.cfg.stream_idle_timeout_s)
            except (UpstreamError, TimeoutError) as e:
                self._fail(inst)
                return error_response(
                    502,
                    f"{role} on {inst.url} broke off: {e}",
                    code="upstream_error",
                    headers={"x-request-id": request_id},
                )
            ticket.outcome = "ok" if resp.status == 200 else "error"
            return _client_response(resp, content, request_id)


MIGRATIONS_PER_STREAM = 3
"""How many times one stream may move to another instance."""


class StreamRelay:
    """One streamed answer, relayed to the client as whole increments (``StreamState``); if
    its upstream fails (the connection breaks, goes idle, ends without ``[DONE]``, or the engine
    ends it with a continuable error) another instance continues it from what the client has.
    ``attempts`` holds the current upstream attempt, released with the ticket."""

    def __init__(
        self,
        proxy: Proxy,
        body: dict[str, Any],
        resume: Resume,
        tried: set[str],
        ticket: Ticket,
        span: Span | None,
    ) -> None:
        self.proxy, self.body, self.resume, self.tried = proxy, body, resume, tried
        self.ticket, self.span = ticket, span
        self.attempts = ExitStack()
        self.state = StreamState()
        self.migrations = 0
        self.move: Resume | None = None  # opens a continuation that carries its KV
        self.drained: set[str] = set()  # instances a drain moved it off (not failures)

    async def chunks(self, resp: UpstreamResponse, inst: Instance) -> AsyncIterator[bytes]:
        """The client's stream; the ticket (not this generator, which may never run or never
        be closed) releases the connection and the load."""
        state, ticket = self.state, self.ticket
        ended = False
        while True:
            try:
                async for chunk in resp.iter_chunks(self.proxy.cfg.stream_idle_timeout_s):
                    out = state.feed(chunk)
                    if out:
                        ticket.chunk(out)
                        if _ends(state, out):  # the client may leave as soon as it has [DONE]
                            ended, ticket.outcome = True, "ok"
                        yield out
                    if state.engine_error is not None:
                        raise UpstreamError("the engine ended the stream with an error")
                if state.tracked and not state.done:
                    raise UpstreamError("the stream ended without [DONE]")
            except (UpstreamError, TimeoutError) as e:
                if ended:  # broke after [DONE]: the client has everything
                    resp.close()
                    return
                failed = await self._failed(resp, inst, e)
                if isinstance(failed, bytes):
                    yield failed
                    return
                resp, inst = failed
                continue
            rest = state.flush()
            ticket.outcome = "ok"
            if rest:
                yield rest
            resp.close()  # read to its end: the connection goes back to the pool
            return

    async def _failed(
        self, resp: UpstreamResponse, inst: Instance, e: Exception
    ) -> bytes | tuple[UpstreamResponse, Instance]:
        """After a mid-stream failure: the continuation's response and instance, or the last
        bytes the client gets (an error event, or ``[DONE]`` for a choice that had finished)."""
        state = self.state
        reason = _reason(e, state)
        error = state.engine_error
        drained = state.moved is not None
        with_kv = moved_body(self.body, state) if drained else None
        resp.close()  # the old upstream stops before another continues (no two writers)
        state.drop_pending()
        if drained:  # moved by a drain: no new requests there, and no failure
            inst.draining = True
            self.drained.add(inst.url)
            # an instance drained before may be admitting again: not excluded for that
            self.tried -= self.drained - {inst.url}
        else:
            self.proxy._fail(inst)
        if state.finished and not state.done:  # only usage and [DONE] were lost
            self.ticket.outcome = "ok"
            return b"data: [DONE]\n\n"
        why = f"upstream {inst.url} broke off: {e}"
        if state.continuable() and self.migrations < MIGRATIONS_PER_STREAM:
            opened = await self._continue(reason, with_kv)
            if not isinstance(opened, str):
                return opened
            why += f"; continuing it failed: {opened}"
        self.ticket.outcome = "error"
        if error is not None and not state.continuable():
            return error + b"data: [DONE]\n\n"
        err = openai_error(502, why, code="upstream_error")
        # a leading blank line ends any event the upstream left half-sent
        return f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()

    async def _continue(
        self, reason: str, with_kv: dict[str, Any] | None
    ) -> tuple[UpstreamResponse, Instance] | str:
        """Open the continuation (recorded in the metric and on the request's span), or why
        it could not be. ``with_kv``: the body that continues a drained stream with its KV,
        tried first; without it (or if it is refused) the stream is recomputed."""
        self.migrations += 1
        if self.span is not None:
            self.span.set_attribute("dsv4.gateway.migrations", self.migrations)
            self.span.set_attribute("dsv4.gateway.migration_reason", reason)
        counter = self.proxy.metrics.migrations
        opened = None
        if with_kv is not None and self.move is not None:
            opened = await self._open(self.move, with_kv, set(self.tried))
        if not isinstance(opened, tuple):
            body = continuation_body(self.body, self.state)
            opened = await self._open(self.resume, body, self.tried)
        if isinstance(opened, str):
            counter.labels(reason, "failed").inc()
            return opened
        new, inst, attempt = opened
        counter.labels(reason, "continued").inc()
        log.info("stream %s continued on %s (%s)", self.state.response_id, inst.url, reason)
        self.attempts.close()  # the failed attempt's load and connection
        self.attempts.enter_context(attempt)
        return new, inst

    async def _open(self, how: Resume, body: dict[str, Any], tried: set[str]) -> Opened | str:
        """One continuation attempt (retried on other instances by ``how``), or why not."""
        try:
            with routing_under(self.span):
                new, inst, attempt = await how(body, tried)
        except (UpstreamFailed, UpstreamError, KVParamsError, TimeoutError) as e:
            return _message(e)
        if new.status != 200:
            attempt.close()
            return f"the continuation was answered {new.status}"
        self.tried |= tried
        return new, inst, attempt


def _ends(state: StreamState, out: bytes) -> bool:
    """Whether ``out`` hands the client the stream's end (an untracked stream is passed
    through as it comes, so its [DONE] is looked for in the bytes)."""
    return state.done or (not state.tracked and out.rstrip().endswith(b"data: [DONE]"))


def _reason(e: Exception, state: StreamState) -> str:
    """The ``reason`` label of a migration."""
    if state.moved is not None:
        return "drain"
    if state.engine_error is not None:
        return "engine_error"
    if isinstance(e, TimeoutError):
        return "idle_timeout"
    return "broken"


def _message(e: Exception) -> str:
    if isinstance(e, UpstreamFailed):
        try:
            return str(json.loads(bytes(e.response.body))["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return f"answered {e.response.status_code}"
    return f"{type(e).__name__}: {e}"


class RelayResponse(StreamingResponse):
    """A streamed answer that ends its request: after ``take_over`` it owns the request's ticket
    and closes it when the stream ends, fails or the client leaves, even if it never started."""

    def __init__(self, content: AsyncIterator[bytes], ticket: Ticket, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.ticket = ticket
        self._closer = ExitStack()

    def take_over(self) -> None:
        self.ticket.outcome = "cancelled"  # until the relay reaches the end or the upstream fails
        self._closer = self.ticket.take_over()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with self._closer:
            await super().__call__(scope, receive, send)
