"""The gateway's HTTP front: OpenAI-compatible, with PD orchestration behind it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from dsv4_kvtransfer.pd_protocol import PREFIX_PULL, KVParamsError
from dsv4_serving.gateway.config import GatewayConfig
from dsv4_serving.gateway.discovery import KubernetesDiscovery, static_members
from dsv4_serving.gateway.fanout import fan_out, fan_out_n
from dsv4_serving.gateway.health import health_loop
from dsv4_serving.gateway.instances import Instance, InstancePool
from dsv4_serving.gateway.kv_subscriber import KVEventFeeds
from dsv4_serving.gateway.lifecycle import Admission, Ticket
from dsv4_serving.gateway.metrics import GatewayMetrics
from dsv4_serving.gateway.openapi import openapi_document
from dsv4_serving.gateway.policies import DPLB, Choice, RouteRequest, make_policy
from dsv4_serving.gateway.prefix_pull import PullCosts, choose_pull, host_prefixes, with_pull
from dsv4_serving.gateway.prompt import load_encoder, route_request
from dsv4_serving.gateway.proxy import Opened, Proxy, RelayResponse, UpstreamFailed, decode_body
from dsv4_serving.gateway.scorers import cached_tokens, parse_weights
from dsv4_serving.gateway.stream_state import FIELD, wants_state, with_state
from dsv4_serving.gateway.tracing import request_span, routing
from dsv4_serving.gateway.tracing import setup as setup_tracing
from dsv4_serving.http.disconnect import Drain, cancel_on_disconnect, drain_on_sigterm
from dsv4_serving.http.errors import error_response

log = logging.getLogger("dsv4.gateway")


class Gateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.pool = InstancePool()
        self.metrics = GatewayMetrics()
        self.admission = Admission(cfg.max_inflight, self.metrics)
        policy = make_policy(cfg.policy, parse_weights(cfg.scorers))
        if isinstance(policy, DPLB):
            policy.on_choice = self._predicted
        # the prediction behind each request's prefill choice (cached tokens, pulled
        # included), until its answer tells the truth
        self._predictions: dict[int, tuple[Choice, int]] = {}
        # the body a request's prefill (or both) choice gets its prefix pull in: the proxy
        # chooses the instance just before it sends, and calls ``_predicted`` with the choice
        self._pull_bodies: dict[int, dict[str, Any]] = {}
        self._kv_bytes = self._kv_tokens = 0  # from PD prefill answers: KV bytes per token
        self.proxy = Proxy(cfg, self.pool, policy, self.metrics)
        self.feeds = KVEventFeeds(
            self.pool, cfg.kv_event_endpoints(), cfg.kv_events_port, self.metrics
        )
        self.encode = load_encoder(cfg.tokenizer, cfg.chat_format, cfg.default_thinking == "on")
        self.drain = Drain(lambda: self.admission.inflight)
        self.proxy.tracer = setup_tracing(cfg.otlp_traces_endpoint)

    @property
    def pd(self) -> bool:
        return bool(
            self.pool.of_role("prefill", healthy_only=False)
            and self.pool.of_role("decode", healthy_only=False)
        )

    async def handle(self, request: Request, path: str, chat: bool) -> Response:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        if self.cfg.api_key is not None:
            auth = request.headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.cfg.api_key}".encode()):
                return error_response(
                    401,
                    "missing or wrong API key (Authorization: Bearer ...)",
                    code="invalid_api_key",
                )
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, f"request body is not valid JSON: {e}", code="invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", code="invalid_body")
        internal = _internal_field(body)
        if internal:  # the engines take it from the gateway only
            return error_response(
                400,
                f"{internal} is internal to this server",
                param=internal,
                code="unsupported_parameter",
            )
        if self.admission.full:
            self.admission.reject()
            return error_response(
                429,
                f"gateway is at its limit of {self.cfg.max_inflight} requests in flight; retry later",
                code="too_many_requests",
                headers={"retry-after": "1"},
            )
        with self.admission.admit() as ticket:
            route = self._route(path, body, chat, rid, ticket)
            if self.proxy.tracer is None:
                response = await cancel_on_disconnect(request, route)
            else:  # the span ends with the ticket; the attempts made while routing are its children
                span = ticket.hold(
                    request_span(
                        self.proxy.tracer, request.headers, body, chat, rid, lambda: ticket.outcome
                    )
                )
                with routing(span):
                    response = await cancel_on_disconnect(request, route)
            if response is None:  # the client left; the upstream calls were cancelled and closed
                ticket.outcome = "cancelled"
                return Response(status_code=499)
            if isinstance(response, RelayResponse):
                response.take_over()  # the stream, not this block, ends the request
            return response

    async def _route(
        self, path: str, body: dict[str, Any], chat: bool, rid: str, ticket: Ticket
    ) -> Response:
        stream = bool(body.get("stream"))
        if wants_state(body):  # a stream of one choice: continued elsewhere if its engine fails
            body = with_state(body)
        req = route_request(body, chat, self.encode, self.feeds.block_size or self.cfg.block_size)
        if self._pulls_on and fan_out_n(body) == 1:  # n > 1: no kv_transfer_params at all
            req = self._with_host_prefixes(req)
            if req.host_prefixes:
                self._pull_bodies[id(req)] = body
        try:
            return await self._dispatch(path, body, chat, rid, ticket, req, stream)
        finally:
            self._predictions.pop(id(req), None)
            self._pull_bodies.pop(id(req), None)

    @property
    def _pulls_on(self) -> bool:
        return self.cfg.prefix_pulls == "on" and self.feeds.enabled

    def _with_host_prefixes(self, req: RouteRequest) -> RouteRequest:
        """``req`` with the prefixes of its prompt that sidecars' host tiers hold (every
        instance's, a decode's included: a session's last answer is there) and the costs."""
        ranks = (c for i in self.pool.all() if i.kv_ranks for c in i.kv_ranks)
        found = host_prefixes(ranks, req.block_hashes, req.token_ids, req.block_size)
        if not found:
            return req
        return replace(req, host_prefixes=found, pull_costs=self._pull_costs())

    def _pull_costs(self) -> PullCosts:
        per_token = self.cfg.prefix_pull_bytes_per_token
        if self._kv_tokens:
            per_token = self._kv_bytes / self._kv_tokens
        return PullCosts(
            per_token,
            self.cfg.prefix_pull_rate,
            prefill_s_per_token=self.cfg.prefill_seconds_per_token,
        )

    def _learn_kv_bytes(self, answer: dict[str, Any]) -> None:
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            return
        nbytes, tokens = params.get("remote_total_bytes"), params.get("remote_num_tokens")
        if isinstance(nbytes, int) and isinstance(tokens, int) and nbytes > 0 and tokens > 0:
            self._kv_bytes += nbytes
            self._kv_tokens += tokens

    async def _dispatch(
        self,
        path: str,
        body: dict[str, Any],
        chat: bool,
        rid: str,
        ticket: Ticket,
        req: RouteRequest,
        stream: bool,
    ) -> Response:
        try:
            if not self.pd:
                return await self.proxy.forward("both", path, body, req, rid, stream, ticket)
            if self.cfg.selective_pd_tokens and self._uncached(req) < self.cfg.selective_pd_tokens:
                self.metrics.selective.inc()
                return await self.proxy.forward("decode", path, body, req, rid, stream, ticket)
            n = fan_out_n(body)
            if n > 1 and stream:  # each choice's stream can be continued on its own
                body = with_state(body)
            if n > 1:  # an engine does n > 1 only without kv_transfer_params: fanout.py
                run = functools.partial(
                    self._pd, path, req=req, rid=rid, stream=stream, ticket=ticket
                )
                return await fan_out(n, body, run, ticket, rid)
            return await self._pd(path, body, lambda: None, req, rid, stream, ticket)
        except UpstreamFailed as e:
            return e.response

    async def _pd(
        self,
        path: str,
        body: dict[str, Any],
        prefilled: Callable[[], None],
        req: RouteRequest,
        rid: str,
        stream: bool,
        ticket: Ticket,
    ) -> Response:
        """Prefill, then decode with its KV (``prefilled`` is called between)."""
        try:
            answer, prefiller = await self.proxy.prefill(path, body, req, rid)
            self._observe_cached(req, answer, prefiller)
            self._learn_kv_bytes(answer)
            prefilled()
            decode = decode_body(body, answer)
        except UpstreamFailed as e:
            return e.response
        except KVParamsError as e:
            return error_response(
                502,
                f"prefill answer unusable for decode: {e}",
                code="upstream_error",
                headers={"x-request-id": rid},
            )
        # the decode pairs with its prefill's revision only (policies.paired_revisions)
        decode_req = RouteRequest(
            prompt_tokens=req.prompt_tokens, stage="decode", revision=prefiller.revision
        )

        async def resume(cont: dict[str, Any], tried: set[str]) -> Opened:
            """A continuation is a PD request of its own: prompt + tokens prefilled, then
            decoded on another decode instance."""
            answer, again = await self.proxy.prefill(path, cont, req, rid)
            return await self.proxy.open(
                "decode",
                path,
                decode_body(cont, answer),
                dataclasses.replace(decode_req, revision=again.revision),
                rid,
                tried,
            )

        try:
            return await self.proxy.forward(
                "decode", path, decode, decode_req, rid, stream, ticket, resume
            )
        except UpstreamFailed as e:
            return e.response

    def _uncached(self, req: RouteRequest) -> int:
        best = max(
            (
                cached_tokens(i, r, req)
                for i in self.pool.of_role("prefill")
                for r in range(i.dp_size)
            ),
            default=0,
        )
        return req.prompt_tokens - best

    def _predicted(self, req: RouteRequest, choice: Choice) -> None:
        """A prefill (or both) choice: its prefix pull into the body (or out of it, on a retry
        elsewhere), and the cached tokens it predicts."""
        cached = choice.cached_tokens
        body = self._pull_bodies.get(id(req))
        if body is not None and req.pull_costs is not None:
            pull = choose_pull(cached, req.host_prefixes, req.pull_costs)
            with_pull(body, pull)
            if pull is not None:
                cached = pull.num_tokens
                self.metrics.prefix_pulls.labels("attached").inc()
            elif max(h.num_tokens for h in req.host_prefixes) > cached:
                self.metrics.prefix_pulls.labels("declined").inc()
        self.metrics.predicted_cached.labels(choice.instance.url).inc(cached)
        self._predictions[id(req)] = (choice, cached)

    def _observe_cached(
        self, req: RouteRequest, answer: dict[str, Any], inst: Instance | None = None
    ) -> None:
        """The prefill's usage says how many prompt tokens it found cached (``inst``'s, or the
        predicting choice's): the truth to the prediction its routing made, if one did."""
        predicted = self._predictions.pop(id(req), None)
        usage = answer.get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        actual = details.get("cached_tokens") if isinstance(details, dict) else None
        if not isinstance(actual, int):
            return
        if predicted is None:  # a policy without predictions: the truth alone
            if inst is not None:
                self.metrics.actual_cached.labels(inst.url).inc(actual)
            return
        choice, cached = predicted
        self.metrics.actual_cached.labels(choice.instance.url).inc(actual)
        self.metrics.cached_error.observe(abs(actual - cached))
        if cached > choice.cached_tokens:  # a pull was attached: did it load?
            self.metrics.prefix_pulls.labels("loaded" if actual >= cached else "computed").inc()


class GatewayApp(Starlette):
    """Starlette, with the two completion routes dispatched before its middleware and router:
    they are nearly all of the traffic and each layer costs CPU per request (an exception
    there still becomes uvicorn's 500)."""

    hot: dict[str, Callable[[Request], Awaitable[Response]]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.hot.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            return await super().__call__(scope, receive, send)
        scope["app"] = self
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


def _client(cfg: GatewayConfig) -> aiohttp.ClientSession:
    """The one upstream HTTP client: the engines' answers pass through undecoded."""
    connector = aiohttp.TCPConnector(
        limit=4 * cfg.max_inflight, limit_per_host=0, keepalive_timeout=60
    )
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(
            total=cfg.prefill_timeout_s, sock_connect=cfg.connect_timeout_s
        ),
    )


def _discover(gw: Gateway) -> KubernetesDiscovery | None:
    """Fill the pool: from the Kubernetes API (watched, returned), or from the static list."""
    if gw.cfg.discovery != "kubernetes":
        static_members(gw.cfg, gw.pool)
        return None
    discovery = KubernetesDiscovery(gw.cfg, gw.pool, asyncio.get_running_loop())
    discovery.start()
    return discovery


def _tune_gc() -> None:
    # the hot path allocates many short-lived objects and almost no cycles: freeze what startup
    # made and collect young objects less often, so collector pauses stay out of the p99
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    """The app's gateway (``app.state.gateway``) at work: its upstream client, members, SIGTERM
    drain and health checks, then all of them closed."""
    gw: Gateway = app.state.gateway
    cfg = gw.cfg
    gw.proxy.client = _client(cfg)
    discovery = _discover(gw)
    drain_on_sigterm(gw.drain, cfg.shutdown_timeout, log)
    feeds = asyncio.create_task(gw.feeds.run()) if gw.feeds.enabled else None
    _tune_gc()
    checker = asyncio.create_task(
        health_loop(
            gw.proxy.client,
            gw.pool,
            gw.metrics,
            cfg.health_interval_s,
            cfg.eject_after_failures,
        )
    )
    try:
        yield
    finally:
        for task in (checker, feeds):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if discovery:
            discovery.stop()
        await gw.proxy.client.close()
        await gw.proxy.upstream.close()


class Endpoints:
    """The gateway's routes over one ``Gateway``: the two completion routes (its hot path),
    the model list, liveness, readiness, its instances, metrics and its OpenAPI document."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.document = openapi_document()

    async def completions(self, request: Request) -> Response:
        return await self.gw.handle(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.gw.handle(request, "/v1/chat/completions", chat=True)

    async def models(self, request: Request) -> Response:
        gw = self.gw
        assert gw.proxy.client is not None
        for role in ("decode", "both", "prefill"):
            for inst in gw.pool.of_role(role):
                try:
                    async with gw.proxy.client.get(
                        f"{inst.url}/v1/models", timeout=aiohttp.ClientTimeout(total=5.0)
                    ) as r:
                        if r.status == 200:
                            return Response(await r.read(), media_type="application/json")
                except (aiohttp.ClientError, TimeoutError):
                    continue
        if gw.cfg.served_model_name:
            return JSONResponse(
                {
                    "object": "list",
                    "data": [
                        {"id": gw.cfg.served_model_name, "object": "model", "owned_by": "dsv4"}
                    ],
                }
            )
        return error_response(503, "no engine is reachable", code="service_unavailable")

    async def health(self, request: Request) -> Response:
        pool = self.gw.pool
        ready = (pool.of_role("prefill") and pool.of_role("decode")) or pool.of_role("both")
        counts = {r: len(pool.of_role(r)) for r in ("prefill", "decode", "both")}
        return JSONResponse(
            {"status": "ok" if ready else "unavailable", "healthy": counts},
            status_code=200 if ready else 503,
        )

    async def ready(self, request: Request) -> Response:
        """Readiness: /health's answer, and 503 once SIGTERM started the drain."""
        if self.gw.drain.draining:
            return error_response(503, "the gateway is shutting down", code="draining")
        return await self.health(request)

    async def instances(self, request: Request) -> Response:
        """What the gateway routes to: role, health and its own load figures per instance."""
        return JSONResponse(
            [
                {
                    "url": i.url,
                    "role": i.role,
                    "healthy": i.healthy,
                    "draining": i.draining,
                    "failures": i.failures,
                    "routed": i.routed,
                    "inflight_requests": i.inflight_requests,
                    "ranks": [vars(r) for r in i.ranks],
                    "kv_events": _kv_state(i),
                }
                for i in sorted(self.gw.pool.all(), key=lambda i: (i.role, i.url))
            ]
        )

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(self.document)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/instances", self.instances, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ]


def _internal_field(body: dict[str, Any]) -> str | None:
    """A field of the request only the gateway may set, if the client sent one."""
    if FIELD in body:
        return FIELD
    params = body.get("kv_transfer_params")
    if isinstance(params, dict) and PREFIX_PULL in params:
        return f"kv_transfer_params.{PREFIX_PULL}"
    return None


def _kv_state(inst: Instance) -> dict[str, Any] | None:
    """The precise prefix index's view of an instance (None: it publishes no KV events)."""
    if inst.kv_ranks is None:
        return None
    return {
        "endpoint": inst.kv_events,
        "ranks": [
            {
                "blocks": len(c.blocks),
                "snapshots": len(c.snapshots),
                "host_entries": len(c.host),
                "host_tier": c.host_tier,
                "next_seq": c.expected,
                "batches": c.batches,
                "resyncs": c.resyncs,
                "lossy_resyncs": c.lossy_resyncs,
                "block_size": c.block_size,
            }
            for c in inst.kv_ranks
        ],
    }


def create_app(cfg: GatewayConfig) -> Starlette:
    """A plain Starlette app: the hot path needs no request validation layer."""
    gw = Gateway(cfg)
    endpoints = Endpoints(gw)
    app = GatewayApp(lifespan=lifespan, routes=endpoints.routes())
    app.hot = {
        "/v1/completions": endpoints.completions,
        "/v1/chat/completions": endpoints.chat_completions,
    }
    app.state.gateway = gw
    return app
