"""PD orchestration, per vLLM's protocol: prefill (max_tokens=1, do_remote_decode) on one
instance, then decode with the returned kv_transfer_params on another, streaming its answer.

Every upstream call has a timeout; a failed prefill is retried on another prefill instance, a
decode that fails before its first byte on another decode instance; upstream responses are
always closed (also when the client goes away, which aborts the engine's request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from starlette.responses import Response, StreamingResponse

from dsv4_kvtransfer.pd_protocol import KVParamsError, decode_request, prefill_request
from dsv4_serving.gateway.config import GatewayConfig
from dsv4_serving.gateway.errors import error
from dsv4_serving.gateway.health import mark_failure, mark_success
from dsv4_serving.gateway.instances import Instance, InstancePool, Role
from dsv4_serving.gateway.metrics import GatewayMetrics
from dsv4_serving.gateway.policies import Choice, Policy, RouteRequest

log = logging.getLogger("dsv4.gateway")
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


@dataclass
class Routed:
    """One in-flight upstream call's bookkeeping, released exactly once."""

    inst: Instance
    rank: int
    tokens: int
    done: bool = False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.inst.end(self.rank, self.tokens)


def _client_response(resp: aiohttp.ClientResponse, content: bytes, request_id: str) -> Response:
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
    return isinstance(err, dict) and err.get("type") == "KVTransferError"


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

    # ---- routing -------------------------------------------------------------------------

    def _choose(self, role: Role, req: RouteRequest, exclude: set[str]) -> Choice | None:
        candidates = [i for i in self.pool.of_role(role) if i.url not in exclude]
        return self.policy.choose(candidates, req)

    def _headers(self, request_id: str, choice: Choice) -> dict[str, str]:
        h = {"x-request-id": request_id, "content-type": "application/json"}
        if choice.instance.dp_size > 1:
            h["x-data-parallel-rank"] = str(choice.rank)  # vLLM's header for DP-rank routing
        return h

    def _fail(self, inst: Instance) -> None:
        mark_failure(inst, self.metrics, self.cfg.eject_after_failures)

    def _attempts(self, role: Role, req: RouteRequest, tried: set[str]) -> Iterator[Choice]:
        """Up to 1 + retries choices of ``role``, never the same instance twice."""
        for attempt in range(self.cfg.retries + 1):
            choice = self._choose(role, req, tried)
            if choice is None:
                return
            tried.add(choice.instance.url)
            if attempt:
                self.metrics.retries.labels(role).inc()
            self.metrics.routed.labels(role, choice.instance.url).inc()
            yield choice

    @staticmethod
    def _exhausted(role: Role, tried: set[str], last: str, request_id: str) -> UpstreamFailed:
        """503 when no instance could be tried, 502 when every one tried failed."""
        if not tried:
            return UpstreamFailed(
                error(
                    503,
                    f"no healthy {role} instance",
                    "service_unavailable",
                    headers={"x-request-id": request_id},
                )
            )
        return UpstreamFailed(
            error(502, last, "upstream_error", headers={"x-request-id": request_id})
        )

    # ---- stages --------------------------------------------------------------------------

    async def prefill(
        self, path: str, body: dict[str, Any], req: RouteRequest, request_id: str
    ) -> tuple[dict[str, Any], Instance]:
        """The prefill answer (JSON) and who gave it; retried on another instance on failure."""
        assert self.client is not None
        tried: set[str] = set()
        last = ""
        for choice in self._attempts("prefill", req, tried):
            inst = choice.instance
            routed = Routed(inst, choice.rank, req.prompt_tokens - choice.cached_tokens)
            inst.begin(routed.rank, routed.tokens)
            try:
                async with self.client.post(
                    inst.url + path,
                    data=json.dumps(prefill_request(body)),
                    headers=self._headers(request_id, choice),
                    timeout=aiohttp.ClientTimeout(
                        total=self.cfg.prefill_timeout_s, sock_connect=self.cfg.connect_timeout_s
                    ),
                ) as resp:
                    status, content = resp.status, await resp.read()
                    if status != 200 and status < 500:  # the request itself is bad: tell the client
                        raise UpstreamFailed(_client_response(resp, content, request_id))
            except (aiohttp.ClientError, TimeoutError) as e:
                self._fail(inst)
                last = f"prefill on {inst.url} failed: {type(e).__name__}: {e}"
                continue
            finally:
                routed.release()
            if status >= 500:
                self._fail(inst)
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

    async def forward(
        self,
        role: Role,
        path: str,
        body: dict[str, Any],
        req: RouteRequest,
        request_id: str,
        stream: bool,
        timer: RequestTimer,
    ) -> Response:
        """Send ``body`` to a ``role`` instance and relay its answer; retried on another instance
        until the first byte. ``timer.done()`` runs once when the answer is finished or abandoned."""
        assert self.client is not None
        tried: set[str] = set()
        last = ""
        for choice in self._attempts(role, req, tried):
            inst = choice.instance
            routed = Routed(inst, choice.rank, req.prompt_tokens)
            inst.begin(routed.rank, routed.tokens)
            resp: aiohttp.ClientResponse | None = None
            handed_over = False  # once a RelayResponse owns resp and routed, it cleans up
            try:
                try:
                    resp = await asyncio.wait_for(
                        self.client.post(
                            inst.url + path,
                            data=json.dumps(body),
                            headers=self._headers(request_id, choice),
                            timeout=aiohttp.ClientTimeout(
                                total=None,
                                sock_connect=self.cfg.connect_timeout_s,
                                sock_read=self.cfg.stream_idle_timeout_s,
                            ),
                        ),
                        self.cfg.first_byte_timeout_s,
                    )
                except (aiohttp.ClientError, TimeoutError) as e:
                    self._fail(inst)
                    last = f"{role} on {inst.url} failed: {type(e).__name__}: {e}"
                    continue
                if resp.status >= 500:
                    content = await resp.read()
                    if not _kv_transfer_error(content):
                        # a failed KV pull is usually the prefill side's fault: retry elsewhere
                        # (the export stays until its lease ends) without holding it against this one
                        self._fail(inst)
                    last = f"{role} on {inst.url} answered {resp.status}: {content[:200]!r}"
                    continue
                mark_success(inst)
                if role != "decode":
                    inst.prefix.add(req.block_hashes)
                if not stream or resp.status != 200:
                    try:
                        content = await resp.read()
                    except (aiohttp.ClientError, TimeoutError) as e:
                        self._fail(inst)
                        timer.done(ok=False)
                        return error(
                            502,
                            f"{role} on {inst.url} broke off: {e}",
                            "upstream_error",
                            headers={"x-request-id": request_id},
                        )
                    timer.done(ok=resp.status == 200)
                    return _client_response(resp, content, request_id)
                handed_over = True
                return RelayResponse(
                    self._relay(resp, routed, inst, timer),
                    on_close=lambda resp=resp, routed=routed: _abandon(resp, routed, timer),
                    status_code=200,
                    media_type=resp.headers.get("content-type", "text/event-stream"),
                    headers={"x-request-id": request_id, "cache-control": "no-cache"},
                )
            finally:
                # every way out of an attempt (errors, retries, cancellation when the client
                # leaves) gives back the instance's load and the connection, unless handed over
                if not handed_over:
                    if resp is not None:
                        resp.close()
                    routed.release()
        raise self._exhausted(role, tried, last, request_id)

    async def _relay(
        self, resp: aiohttp.ClientResponse, routed: Routed, inst: Instance, timer: RequestTimer
    ) -> AsyncIterator[bytes]:
        ok = False
        try:
            async for chunk in resp.content.iter_any():
                timer.chunk()
                yield chunk
            ok = True
        except (aiohttp.ClientError, TimeoutError) as e:
            # mid-stream failure: the client already has a 200; end the stream with an error event
            self._fail(inst)
            msg = json.dumps(
                {
                    "error": {
                        "message": f"upstream {inst.url} broke off: {e}",
                        "type": "upstream_error",
                        "code": "upstream_error",
                    }
                }
            )
            # a leading blank line ends any event the upstream left half-sent
            yield f"\n\ndata: {msg}\n\ndata: [DONE]\n\n".encode()
        finally:
            # close (not release) when cut short: dropping the connection aborts the engine's request
            if ok:
                resp.release()
            else:
                resp.close()
            routed.release()
            timer.done(ok=ok)


def _abandon(resp: aiohttp.ClientResponse, routed: Routed, timer: RequestTimer) -> None:
    """Clean-up for a relay whose body iterator may never have run (client gone before the first
    send): idempotent with the iterator's own ``finally``."""
    if not resp.closed:
        resp.close()
    routed.release()
    timer.done(ok=False)


class RelayResponse(StreamingResponse):
    """A streaming response that always runs ``on_close``, even if its iterator never starts."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class RequestTimer:
    """Latency as the client sees it; ``done`` is idempotent and releases the in-flight slot."""

    def __init__(self, metrics: GatewayMetrics, release: Callable[[], None]) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: float | None = None
        self._release = release
        self.finished = False

    def chunk(self) -> None:
        t = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(t - self.start)
        else:
            self.metrics.itl.observe(t - self.last)
        self.last = t

    def done(self, ok: bool = True) -> None:
        if self.finished:
            return
        self.finished = True
        if ok:
            self.metrics.e2e.observe(time.perf_counter() - self.start)
        self.metrics.requests.labels("ok" if ok else "error").inc()
        self._release()


async def race_disconnect(
    work: Awaitable[Response], disconnected: Callable[[], Awaitable[Any]]
) -> Response | None:
    """Run ``work``; if the client goes away first, cancel it (closing upstream calls) and return
    None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None
    finally:
        watcher.cancel()
        if not task.done():  # this coroutine itself was cancelled
            task.cancel()
