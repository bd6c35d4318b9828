"""kopf handlers: thin. Every event of a DeepSeekV4Deployment or of one of its children asks for
a sync of that deployment; the Controller does the work. No handler writes to the CR, so kopf
keeps no state there and a restart changes nothing. The controller and the queue live in kopf's
``memo`` (built at startup from what ``dsv4 operator`` put there), not in a module global."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import kopf

from dsv4_operator.api import GROUP, PLURAL, VERSION
from dsv4_operator.controller import Controller
from dsv4_operator.kube import Kube, load_api_client
from dsv4_operator.observe import LWS_CRD
from dsv4_operator.queue import SyncQueue
from dsv4_operator.reconcile import names

CHILD_RESOURCES = [
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "pods"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("", "v1", "secrets"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    # kopf skips a resource its cluster does not serve; the CRD watch below resyncs when it appears
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
]
MANAGED = {"app.kubernetes.io/managed-by": names.MANAGER}


@dataclass
class OperatorMemo:
    """kopf's memo: one per operator, shallow-copied per object (so every copy shares these)."""

    kubeconfig: str | None = None
    controller: Controller | None = None
    queue: SyncQueue | None = None

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
    memo.controller = Controller(Kube(load_api_client(memo.kubeconfig)))
    memo.queue = SyncQueue(memo.controller.sync)
    logger.info("dsv4 operator started")


@kopf.on.cleanup()
async def cleanup(memo: OperatorMemo, **_: Any) -> None:
    if memo.queue is not None:
        await memo.queue.drain()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def deployment_event(
    event: kopf.RawEvent, namespace: str | None, name: str, memo: OperatorMemo, **_: Any
) -> None:
    if namespace is None:
        return
    if event["type"] == "DELETED":
        memo.sync_queue().forget((namespace, name))
        return
    memo.sync_queue().enqueue((namespace, name))


async def _child_event(
    namespace: str | None, labels: kopf.Labels, memo: OperatorMemo, **_: Any
) -> None:
    owner = labels.get(names.DEPLOYMENT_LABEL)
    if owner and namespace:
        memo.sync_queue().enqueue((namespace, owner))


@kopf.on.event(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", field="metadata.name", value=LWS_CRD
)
async def lws_crd_event(memo: OperatorMemo, **_: Any) -> None:
    """LeaderWorkerSet installed or removed: deployments that want it must be synced again."""
    if memo.controller is not None:
        memo.controller.forget_lws()
    memo.sync_queue().enqueue_all()


for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(_group, _version, _plural, labels=MANAGED, id=f"child-{_plural}")(_child_event)
