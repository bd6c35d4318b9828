"""The autoscaler's loop: one asyncio task per DeepSeekV4Deployment with autoscaling on, in the
operator's event loop.

Every ``intervalSeconds``: count the instances (watch cache), observe (the gateway pods'
``/metrics`` and ``/instances``, or Prometheus), ``decide``, start / step / cancel the drain of a
scaled-down instance (its engine's and sidecar's ``/metrics`` read directly), then hand the sync
a ``ScalePlan`` and ask for a sync: the sync is the one writer of children and status. The
decide ``State`` lives here, in memory: a restarted operator starts a fresh one
(``State(started_at=now)``: no scale-down for one window) and resumes the targets and drains
from the status (``plan.from_status``).

Tasks are started from the deployment's watch events, which only the active replica receives
(kopf pauses a standby's watches), and stopped when autoscaling is turned off, the deployment
is deleted, or the operator stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import aiohttp

from dsv4_common.ports import ENGINE_PORT
from dsv4_common.process import metric_value
from dsv4_operator.api.rolescale import ROLE_SCALE_KIND
from dsv4_operator.api.spec import DeploymentSpec, parse
from dsv4_operator.autoscaling import drain as drains
from dsv4_operator.autoscaling.counts import BLOCKED_AFTER_S, role_counts
from dsv4_operator.autoscaling.decide import Decision, Event, State, decide
from dsv4_operator.autoscaling.external import external_decision
from dsv4_operator.autoscaling.from_spec import npus_per_instance, policy_of
from dsv4_operator.autoscaling.gateway_source import (
    GatewayWindow,
    RoleCounts,
    Snapshot,
    parse_histograms,
    parse_instances,
)
from dsv4_operator.autoscaling.leader import is_active
from dsv4_operator.autoscaling.plan import PlanBook, ScalePlan, rank0_selector, role_scale_name
from dsv4_operator.autoscaling.policy import ROLES, Role
from dsv4_operator.autoscaling.prometheus_source import Queries, observations, scalar
from dsv4_operator.autoscaling.report import (
    autoscaling_status,
    conditions,
    latency_status,
    record_metrics,
)
from dsv4_operator.autoscaling.signals import Observations
from dsv4_operator.cache import Owner, WatchCache
from dsv4_operator.events import now as iso_now
from dsv4_operator.events import post_event
from dsv4_operator.kube import KubeApi
from dsv4_operator.reconcile import names

log = logging.getLogger("dsv4.autoscaler")

EVENT_DEDUP_S = 300.0
DRAIN_MIN_GAP_S = 2.0
"""Two idle reads of a victim at least this far apart (the gateway's health interval): a request
routed just before every gateway saw the drain shows up between them."""
HTTP_TIMEOUT_S = 3.0
RECENT_TICKS = 3
"""The gateway source's recent prompt-token rate spans this many ticks (capped at the window)."""


@dataclass(frozen=True)
class LoopOptions:
    metrics_address: str | None = None
    """host:port that replaces every pod address (gateway, engine, sidecar): tests only, where
    kwok pods have no reachable IP and one stub serves them all."""
    address_map: str | None = None
    """Tests only: a JSON file ``{pod name: {port: "host:port"}}``, read on every lookup, that
    gives each kwok pod's port the address of the process playing it (engines run as local
    processes); a pod or port it does not name has no address."""
    blocked_after_s: float = BLOCKED_AFTER_S
    peering: str | None = None
    """kopf's peering object name (None: standalone, always active)."""
    priority: int = 0
    clusterwide: bool = True


class Autoscalers:
    def __init__(
        self,
        kube: KubeApi,
        cache: WatchCache,
        plans: PlanBook,
        enqueue: Callable[[Owner], None],
        options: LoopOptions | None = None,
    ) -> None:
        self.kube, self.cache, self.plans, self.enqueue = kube, cache, plans, enqueue
        self.options = options or LoopOptions()
        self._tasks: dict[Owner, asyncio.Task[None]] = {}

    def ensure(self, body: Mapping[str, Any]) -> None:
        """Start or stop the deployment's loop as its spec says (call on every event)."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        try:
            a = parse(dict(body)).autoscaling
            on = a.enabled and not meta.get("deletionTimestamp")
        except (KeyError, ValueError, TypeError):
            on = False  # a spec the sync reports as broken
        task = self._tasks.get(key)
        if on and (task is None or task.done()):  # a loop that ended on its own restarts
            self._tasks[key] = asyncio.create_task(self._run(key), name=f"autoscaler {key}")
        elif not on and key in self._tasks:
            self.stop(key)

    def stop(self, key: Owner) -> None:
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()
        self.plans.forget(*key)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _run(self, key: Owner) -> None:
        tick = _Tick(self, key)
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        ) as http:
            while True:
                try:
                    interval = await tick.run(http)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("autoscaler tick of %s/%s failed", *key)
                    interval = 5.0
                if interval is None:
                    return
                await asyncio.sleep(interval)


class _Tick:
    """The loop's memory for one deployment, and one tick's work (``run``)."""

    def __init__(self, owner: Autoscalers, key: Owner) -> None:
        self.o, self.key = owner, key
        self.state: State | None = None
        self.window: GatewayWindow | None = None
        self.drains: dict[Role, drains.Drain] = {}
        self.undrain: set[tuple[Role, str]] = set()
        """Cancelled drains whose engine has yet to answer ``DELETE /drain``."""
        self.resumed = False
        self.posted: dict[tuple[str, str], float] = {}
        self.last_scale: str | None = None
        self.last_logged = ""

    def _log(self, decision: Decision) -> None:
        """Each tick's decision per role in the log: at INFO when it differs from the last
        one by more than its figures (why a role holds is otherwise only in the status)."""
        line = "; ".join(
            f"{r} {d.current}->{d.target} {d.direction}: {d.reason}"
            for r, d in decision.roles.items()
        )
        shape = re.sub(r"[0-9.]+", "#", line)
        level = logging.INFO if shape != self.last_logged else logging.DEBUG
        self.last_logged = shape
        log.log(level, "%s/%s: %s", *self.key, line)

    async def run(self, http: aiohttp.ClientSession) -> float | None:
        """One tick; the seconds to the next, or None when the loop should end."""
        body = self.o.cache.deployment(*self.key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        spec = parse(body)
        a = spec.autoscaling
        if not a.enabled:
            return None
        if not await self._active():
            # a standby: its successor's State starts fresh when it takes over
            self.state, self.resumed, self.drains = None, False, {}
            return float(a.interval_s)
        now = time.time()
        base = self._resume(spec, body, now)
        counts = self._counts(spec, base, now)
        obs: Observations | None = None
        if a.mode == "External":
            decision = external_decision(spec, base, counts, self._wanted(spec))
        else:
            obs = await self._observe(http, spec, counts)
            assert self.state is not None
            decision, self.state = decide(
                obs, self.state, policy_of(a, npus_per_instance(spec)), now
            )
            self._log(decision)
        targets = dict(base.targets)
        events: list[Event] = list(decision.events)
        await self._scale(http, spec, decision, targets, events, now)
        await self._step_drains(http, spec, targets, events, now)
        plan = ScalePlan(
            targets,
            {r: tuple(x.instance for x in self.drains.values() if x.role == r) for r in ROLES},
            autoscaling=autoscaling_status(
                decision,
                list(self.drains.values()),
                source="External" if a.mode == "External" else a.metrics.source,
                observed_at=_iso(obs.observed_at) if obs is not None else None,
                last_scale_time=self.last_scale,
            ),
            metrics=latency_status(decision) or dict(base.metrics),
            conditions=tuple(conditions(decision)),
        )
        self.o.plans.put(*self.key, plan)
        self.o.enqueue(self.key)
        age = now - obs.observed_at if obs is not None else None
        record_metrics(spec.namespace, spec.name, decision, age)
        await self._post(body, events, now)
        if a.mode == "External":
            await self._report_scales(spec, counts)
        return float(a.interval_s)

    def _resume(self, spec: DeploymentSpec, body: Mapping[str, Any], now: float) -> ScalePlan:
        """The plan this tick starts from; the first tick also sets up the loop's memory and
        takes up the drains a restarted operator's predecessor left in the status."""
        a = spec.autoscaling
        if self.state is None:
            self.state = State(started_at=now)
        recent_s = min(float(a.window_s), RECENT_TICKS * a.interval_s)
        if self.window is None or (self.window.window_s, self.window.recent_s) != (
            a.window_s,
            recent_s,
        ):
            self.window = GatewayWindow(float(a.window_s), recent_s)
        base = self.o.plans.plan_for(spec, body.get("status"))
        assert base is not None
        if not self.resumed:
            for r in ROLES:
                for inst in base.draining[r][:1]:
                    self.drains[r] = drains.Drain(inst, r, now)
                    log.info("resuming the drain of %s", inst)
            self.resumed = True
        return base

    async def _scale(
        self,
        http: aiohttp.ClientSession,
        spec: DeploymentSpec,
        decision: Decision,
        targets: dict[Role, int],
        events: list[Event],
        now: float,
    ) -> None:
        """The decision applied to ``targets``: up at once (cancelling that role's drain), down
        one instance at a time, the last one drained first."""
        for r in ROLES:
            d = decision.roles[r]
            if d.direction == "up":
                dr = self.drains.pop(r, None)
                if dr is not None:
                    events.append(drains.cancel(dr, f"{r} scales up again"))
                    self.undrain.add((r, dr.instance))
                targets[r] = max(targets[r], d.target)
                self.last_scale = iso_now()
            elif d.direction == "down" and r not in self.drains and targets[r] > 0:
                targets[r] -= 1
                victim = names.instance_name(spec, r, targets[r])
                read = await self._read_victim(http, spec, victim)
                self.drains[r], started = drains.start(victim, r, now, read)
                events.append(started)

    async def _step_drains(
        self,
        http: aiohttp.ClientSession,
        spec: DeploymentSpec,
        targets: dict[Role, int],
        events: list[Event],
        now: float,
    ) -> None:
        """Each drain one step on: an instance done (or out of time) is removed."""
        timeout_s = spec.autoscaling.drain_timeout_s
        await self._undrain(http, spec)
        for r, dr in list(self.drains.items()):
            answer = await self._ask_drain(http, spec, dr.instance)
            dr, migrating = drains.asked(dr, answer)
            if migrating is not None:
                events.append(migrating)
            read = drains.with_answer(await self._read_victim(http, spec, dr.instance), answer)
            dr, outcome, stepped = drains.step(dr, read, now, timeout_s, DRAIN_MIN_GAP_S)
            self.drains[r] = dr
            if stepped is not None:
                events.append(stepped)
            if outcome != "draining":
                del self.drains[r]
                self.last_scale = iso_now()
                events.append(
                    Event(
                        "Normal",
                        "ScaledDown",
                        f"{r} -> {targets[r]}: {dr.instance} removed after "
                        f"{now - dr.started_at:.0f}s of drain",
                    )
                )

    def _wanted(self, spec: DeploymentSpec) -> dict[Role, int | None]:
        live = self.o.cache.children(spec, False)
        out: dict[Role, int | None] = {}
        for r in ROLES:
            obj = live.get((ROLE_SCALE_KIND, role_scale_name(spec, r))) or {}
            value = (obj.get("spec") or {}).get("replicas")
            out[r] = int(value) if isinstance(value, int) else None
        return out

    async def _report_scales(self, spec: DeploymentSpec, counts: dict[Role, RoleCounts]) -> None:
        """``status`` of each role's scale object: what an HPA reads back."""
        live = self.o.cache.children(spec, False)
        for r in ROLES:
            name = role_scale_name(spec, r)
            obj = live.get((ROLE_SCALE_KIND, name))
            if obj is None:
                continue  # the sync creates it
            status = {
                "replicas": counts[r].ready + counts[r].starting,
                "selector": rank0_selector(spec, r),
            }
            if obj.get("status") != status:
                written = await asyncio.to_thread(
                    self.o.kube.patch_status, ROLE_SCALE_KIND, spec.namespace, name, status
                )
                self.o.cache.record(ROLE_SCALE_KIND, written)

    async def _active(self) -> bool:
        opts = self.o.options
        if opts.peering is None:
            return True
        kind = "ClusterKopfPeering" if opts.clusterwide else "KopfPeering"
        obj = await asyncio.to_thread(self.o.kube.get, kind, self.key[0], opts.peering)
        return is_active((obj or {}).get("status"), opts.priority, datetime.now(UTC))

    def _counts(self, spec: DeploymentSpec, base: ScalePlan, now: float) -> dict[Role, RoleCounts]:
        live = self.o.cache.children(spec, False)
        workloads = [obj for (kind, _), obj in live.items() if kind == "StatefulSet"]
        pods = self.o.cache.pods(spec)
        draining = {r: {d.instance for d in self.drains.values() if d.role == r} for r in ROLES}
        counts = role_counts(workloads, pods, draining, now, self.o.options.blocked_after_s)
        out: dict[Role, RoleCounts] = {}
        for r, c in counts.items():
            # instances asked for but not yet in the cache are on their way: starting
            missing = max(0, base.targets[r] - c.ready - c.starting)
            out[r] = replace(c, starting=c.starting + missing)
        return out

    def _address(self, pod: Mapping[str, Any] | None, port: int) -> str | None:
        if self.o.options.metrics_address:
            return self.o.options.metrics_address
        if self.o.options.address_map:
            return mapped_address(self.o.options.address_map, pod, port)
        ip = ((pod or {}).get("status") or {}).get("podIP")
        return f"{ip}:{port}" if ip else None

    async def _observe(
        self, http: aiohttp.ClientSession, spec: DeploymentSpec, counts: dict[Role, RoleCounts]
    ) -> Observations | None:
        if spec.autoscaling.metrics.source == "Prometheus":
            return await self._observe_prometheus(http, spec, counts)
        assert self.window is not None
        gateways = [
            p
            for p in self.o.cache.pods(spec)
            if (p["metadata"].get("labels") or {}).get(names.ROLE_LABEL) == "gateway"
            and (p.get("status") or {}).get("phase") == "Running"
        ]
        if self.o.options.metrics_address:
            gateways = gateways[:1] or [{"metadata": {"name": "override"}}]
        live = []
        for pod in gateways:
            pod_name = pod["metadata"]["name"]
            addr = self._address(pod, names.GATEWAY_PORT)
            if addr is None:
                continue
            live.append(pod_name)
            try:
                text = await _get_text(http, f"http://{addr}/metrics")
                doc = await _get_json(http, f"http://{addr}/instances")
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                log.warning("gateway %s unreadable: %s", pod_name, e)
                continue  # its older snapshots make the window stale: the tick holds
            instances = doc if isinstance(doc, list) else doc.get("instances", [])
            self.window.add(
                pod_name, Snapshot(time.time(), parse_histograms(text), parse_instances(instances))
            )
        self.window.forget(live)
        return self.window.observations(counts)

    async def _observe_prometheus(
        self, http: aiohttp.ClientSession, spec: DeploymentSpec, counts: dict[Role, RoleCounts]
    ) -> Observations | None:
        url = (spec.autoscaling.metrics.prometheus_url or "").rstrip("/")
        q = Queries(spec.name, spec.namespace, float(spec.autoscaling.window_s))
        values: dict[str, float | None] = {}
        try:
            for key, promql in q.all().items():
                async with http.get(f"{url}/api/v1/query", params={"query": promql}) as resp:
                    values[key] = scalar(await resp.json(content_type=None))
        except Exception as e:  # unreachable, or an answer we cannot read: the tick holds
            log.warning("prometheus %s unreadable: %s", url, e)
            return None
        return observations(values, counts)

    def _rank0(self, spec: DeploymentSpec, instance: str) -> Mapping[str, Any] | None:
        """The instance's rank-0 pod: the only one serving HTTP (the other ranks of a
        multi-node instance have no front end)."""
        return next(
            (p for p in self.o.cache.pods(spec) if p["metadata"]["name"] == f"{instance}-0"),
            None,
        )

    def _engine_address(self, spec: DeploymentSpec, instance: str) -> str | None:
        return self._address(self._rank0(spec, instance), ENGINE_PORT)

    async def _ask_drain(
        self, http: aiohttp.ClientSession, spec: DeploymentSpec, instance: str
    ) -> drains.DrainAnswer | None:
        """``POST /drain {"migrate": true}`` on the victim (idempotent: asked on every tick of
        the drain, so a failed call is retried and a stream that was still in its prefill at
        the last call moves at this one). None: no answer (the drain waits instead)."""
        engine = self._engine_address(spec, instance)
        if engine is None:
            return None
        try:
            async with http.post(f"http://{engine}/drain", json={"migrate": True}) as resp:
                resp.raise_for_status()
                return drains.parse_answer(await resp.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("POST /drain to %s failed: %s", instance, e)
            return None

    async def _undrain(self, http: aiohttp.ClientSession, spec: DeploymentSpec) -> None:
        """``DELETE /drain`` on each instance a scale-up took back, until it answers (409: it
        got a SIGTERM meanwhile, nothing to call off); an instance whose pod is gone is
        dropped."""
        for r, instance in sorted(self.undrain):
            if any(d.instance == instance for d in self.drains.values()):
                self.undrain.discard((r, instance))  # drained again since
                continue
            engine = self._engine_address(spec, instance)
            if engine is None:
                self.undrain.discard((r, instance))
                continue
            try:
                async with http.delete(f"http://{engine}/drain") as resp:
                    if resp.status != 409:
                        resp.raise_for_status()
            except (aiohttp.ClientError, TimeoutError) as e:
                log.warning("DELETE /drain to %s failed (retried next tick): %s", instance, e)
                continue
            self.undrain.discard((r, instance))

    async def _read_victim(
        self, http: aiohttp.ClientSession, spec: DeploymentSpec, instance: str
    ) -> drains.IdleRead | None:
        """The victim's rank-0 engine queue and its sidecar's held KV exports (a prefill's for
        remote decodes; a decode's streams moved by ``POST /drain``, until the peers pulled)."""
        pod = self._rank0(spec, instance)
        engine = self._address(pod, ENGINE_PORT)
        sidecar = self._address(pod, spec.kv.metrics_port)
        if engine is None or sidecar is None:
            return None
        try:
            text = await _get_text(http, f"http://{engine}/metrics")
            side = await _get_text(http, f"http://{sidecar}/metrics")
            exports = metric_value(side, "dsv4_kv_active_exports")
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("drain read of %s failed: %s", instance, e)
            return None
        return drains.IdleRead(
            time.time(),
            running=metric_value(text, "vllm:num_requests_running"),
            waiting=metric_value(text, "vllm:num_requests_waiting"),
            exports=exports,
        )

    async def _post(self, body: dict[str, Any], events: list[Event], now: float) -> None:
        """Each event once per ``EVENT_DEDUP_S`` (Warnings per reason, others per message)."""
        for e in events:
            key = (e.reason, "" if e.type == "Warning" else e.message)
            if now - self.posted.get(key, -EVENT_DEDUP_S) < EVENT_DEDUP_S:
                continue
            self.posted[key] = now
            await asyncio.to_thread(
                post_event, self.o.kube, body, e.reason, e.message, e.type == "Warning"
            )


def mapped_address(path: str, pod: Mapping[str, Any] | None, port: int) -> str | None:
    """``LoopOptions.address_map``'s address of ``pod``'s ``port`` (None: not named, or the
    file is unreadable: the read fails and the tick holds, as with an unreachable pod)."""
    if pod is None:
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    addr = (doc.get(pod["metadata"]["name"]) or {}).get(str(port))
    return str(addr) if addr else None


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


async def _get_text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url) as resp:
        resp.raise_for_status()
        return await resp.text()


async def _get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)
