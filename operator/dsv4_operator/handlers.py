"""kopf handlers: thin. Every event of a DeepSeekV4Deployment or of one of its children asks for
a sync of that deployment; the Controller does the work. No handler writes to the CR, so kopf
keeps no state there and a restart changes nothing."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from dsv4_operator.api import GROUP, PLURAL, VERSION
from dsv4_operator.controller import Controller
from dsv4_operator.kube import Kube, load_api_client
from dsv4_operator.observe import LWS_CRD
from dsv4_operator.queue import SyncQueue
from dsv4_operator.reconcile import names

_state: dict[str, Any] = {}

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


def _queue() -> SyncQueue:
    return _state["queue"]  # type: ignore[no-any-return]


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, logger: kopf.Logger, **_: Any) -> None:
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    controller = Controller(Kube(load_api_client(_state.get("kubeconfig"))))
    _state["controller"] = controller
    _state["queue"] = SyncQueue(controller.sync)
    logger.info("dsv4 operator started")


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    if "queue" in _state:
        await _state["queue"].drain()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def deployment_event(
    event: kopf.RawEvent, namespace: str | None, name: str, **_: Any
) -> None:
    if namespace is None:
        return
    if event["type"] == "DELETED":
        _queue().forget((namespace, name))
        return
    _queue().enqueue((namespace, name))


async def _child_event(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    owner = labels.get(names.DEPLOYMENT_LABEL)
    if owner and namespace:
        _queue().enqueue((namespace, owner))


@kopf.on.event(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", field="metadata.name", value=LWS_CRD
)
async def lws_crd_event(**_: Any) -> None:
    """LeaderWorkerSet installed or removed: deployments that want it must be synced again."""
    _state["controller"].forget_lws()
    _queue().enqueue_all()


for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(_group, _version, _plural, labels=MANAGED, id=f"child-{_plural}")(_child_event)
