"""kopf handlers: thin. Every event of a DeepSeekV4Deployment or of one of its children asks for
a sync of that deployment; the Controller does the work. No handler writes to the CR, so kopf
keeps no state there and a restart changes nothing. The controller, the queue and the watch
cache live in kopf's ``memo`` (built at startup from what ``dsv4 operator`` put there), not in a
module global. The cache is filled by kopf index functions, so no handler runs (and no sync
starts) before every child kind and the pods have been listed once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from dsv4_operator.api import GROUP, PLURAL, VERSION
from dsv4_operator.autoscaling.loop import Autoscalers, LoopOptions
from dsv4_operator.autoscaling.plan import PlanBook
from dsv4_operator.cache import WatchCache, owner_of
from dsv4_operator.controller import Controller
from dsv4_operator.kube import Kube, load_api_client
from dsv4_operator.observe import LWS_CRD
from dsv4_operator.queue import SyncQueue
from dsv4_operator.reconcile.host_access import HostAccess

# (group, version, plural, kind) of everything a deployment owns, and its engine pods
CHILD_RESOURCES = [
    ("apps", "v1", "statefulsets", "StatefulSet"),
    ("apps", "v1", "deployments", "Deployment"),
    ("", "v1", "services", "Service"),
    ("", "v1", "configmaps", "ConfigMap"),
    ("", "v1", "pods", "Pod"),
    ("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    ("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    ("", "v1", "secrets", "Secret"),
    ("", "v1", "serviceaccounts", "ServiceAccount"),
    ("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    # kopf skips a resource its cluster does not serve; the CRD watch below resyncs when it appears
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet"),
    (GROUP, VERSION, "deepseekv4rolescales", "DeepSeekV4RoleScale"),
]


CLEANUP_S = 3.0
"""How long a stop waits for the syncs in flight."""


@dataclass
class OperatorMemo:
    """kopf's memo: one per operator, shallow-copied per object (so every copy shares these)."""

    kubeconfig: str | None = None
    host_access: HostAccess = field(default_factory=HostAccess)
    cache: WatchCache = field(default_factory=WatchCache)
    controller: Controller | None = None
    queue: SyncQueue | None = None
    autoscaler_options: LoopOptions = field(default_factory=LoopOptions)
    plans: PlanBook = field(default_factory=PlanBook)
    autoscalers: Autoscalers | None = None

    def idle(self) -> bool:
        """No sync is running (nothing holds the process's exit)."""
        return self.queue is None or self.queue.idle()

    def sync_queue(self) -> SyncQueue:
        assert self.queue is not None, "startup builds the queue before any watch runs"
        return self.queue


@kopf.on.startup()
async def startup(
    settings: kopf.OperatorSettings, memo: OperatorMemo, logger: kopf.Logger, **_: Any
) -> None:
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    kube = Kube(load_api_client(memo.kubeconfig))
    memo.controller = Controller(kube, memo.cache, memo.host_access, memo.plans)
    memo.queue = SyncQueue(memo.controller.sync)
    memo.autoscalers = Autoscalers(
        kube, memo.cache, memo.plans, memo.queue.enqueue, memo.autoscaler_options
    )
    logger.info("dsv4 operator started")


@kopf.on.cleanup()
async def cleanup(memo: OperatorMemo, **_: Any) -> None:
    if memo.autoscalers is not None:
        await memo.autoscalers.close()
    if memo.queue is not None:
        # bounded: a sync waiting on an unreachable API server must not hold the exit
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(memo.queue.drain(), CLEANUP_S)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def deployment_event(
    event: kopf.RawEvent, namespace: str | None, name: str, memo: OperatorMemo, **_: Any
) -> None:
    if namespace is None:
        return
    if event["type"] == "DELETED":
        memo.cache.forget_deployment(namespace, name)
        memo.sync_queue().forget((namespace, name))
        if memo.autoscalers is not None:
            memo.autoscalers.stop((namespace, name))
        return
    body = dict(event["object"])
    if memo.cache.record_deployment(body):  # not the echo of our status patch
        memo.sync_queue().enqueue((namespace, name))
    if memo.autoscalers is not None:
        memo.autoscalers.ensure(body)


def _cache_child(kind: str) -> Callable[..., Awaitable[None]]:
    async def index(body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
        # every event but DELETED, before any handler sees it (async: no thread hop per event);
        # kopf's own index stays empty. A version already recorded (the echo of a sync's own
        # write, which that sync's status already describes) syncs nothing.
        obj = dict(body)
        owner = owner_of(obj)
        if memo.cache.record(kind, obj) and owner is not None and memo.queue is not None:
            memo.queue.enqueue_known(owner)

    return index


def _child_event(kind: str) -> Callable[..., Awaitable[None]]:
    async def on_event(event: kopf.RawEvent, memo: OperatorMemo, **_: Any) -> None:
        if event["type"] != "DELETED":
            return  # the index above recorded it and asked for a sync when it was news
        obj = dict(event["object"])
        memo.cache.forget(kind, obj)
        owner = owner_of(obj)
        if owner is not None:
            memo.sync_queue().enqueue_known(owner)

    return on_event


@kopf.on.event(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", field="metadata.name", value=LWS_CRD
)
async def lws_crd_event(memo: OperatorMemo, **_: Any) -> None:
    """LeaderWorkerSet installed or removed: deployments that want it must be synced again."""
    if memo.controller is not None:
        memo.controller.forget_lws()
    memo.sync_queue().enqueue_all()


# Unfiltered (kopf watches whole resources anyway, it filters labels client-side): the cache's
# name index needs every object of an owned kind, managed or not.
for _group, _version, _plural, _kind in CHILD_RESOURCES:
    kopf.index(_group, _version, _plural, id=f"cache-{_plural}")(_cache_child(_kind))
    kopf.on.event(_group, _version, _plural, id=f"child-{_plural}")(_child_event(_kind))
