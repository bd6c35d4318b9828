"""What the watches report, so a sync reads from memory instead of the API server:
controller-runtime's informer cache, fed by kopf. Three parts:

- every managed object (children and engine pods), by deployment;
- the name of every object of an owned kind in the watched namespaces, managed or not, with its
  owners' uids: a desired child whose name is free needs no GET before it is created;
- each DeepSeekV4Deployment as its watch (or our status patch) last reported it.

kopf runs no handler until every indexed resource kind has been listed once (its indexes'
pre-population), and ``handlers`` fills this cache from index functions, so a sync never sees a
half-filled cache after a restart. Still, the cache may lag behind the API server for a moment:
a desired child the name index knows but the children lack is read (GET) before anything is
written, and what a sync writes is recorded here at once (``remember``), so lag costs a read,
never a wrong write. The one race left: an object someone else creates under one of our names a
few milliseconds before our create, not yet reported by its watch, is adopted by our forced
apply instead of refused: accepted, as the window is one watch delay and the name is ours by
convention (``{deployment}-...``).
"""

from __future__ import annotations

import threading
from typing import Any

from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.children import OWNED_KINDS, ApplyResult, Live, owned_by
from dsv4_operator.reconcile import names

Owner = tuple[str, str]  # (namespace, deployment name)
_NAMED_KINDS = {*OWNED_KINDS, "LeaderWorkerSet"}


def version(obj: dict[str, Any]) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion") or 0)
    except ValueError:  # opaque to clients in principle; etcd's are integers
        return 0


def owner_of(obj: dict[str, Any]) -> Owner | None:
    """The deployment a managed object belongs to (None for anyone else's object, e.g. one
    Helm labelled with the same instance label)."""
    meta = obj["metadata"]
    labels = meta.get("labels") or {}
    owner = labels.get(names.DEPLOYMENT_LABEL)
    if not owner or labels.get(names.MANAGED_BY_LABEL) != names.MANAGER:
        return None
    return (meta.get("namespace", ""), owner)


class WatchCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # watches write on the event loop, syncs read in threads
        self._objects: dict[Owner, dict[tuple[str, str], dict[str, Any]]] = {}
        self._names: set[tuple[str, str, str]] = set()  # (kind, namespace, name)
        self._deployments: dict[Owner, dict[str, Any]] = {}

    def record(self, kind: str, obj: dict[str, Any]) -> bool:
        """An object as a watch (or a write) reported it; an older version never replaces a
        newer. Whether it was news: False for a version already recorded (e.g. the watch event
        of our own write, whose answer ``remember`` recorded)."""
        meta = obj["metadata"]
        with self._lock:
            if kind in _NAMED_KINDS:
                self._names.add((kind, meta.get("namespace", ""), meta["name"]))
            owner = owner_of(obj)
            if owner is None:
                return True
            key = (kind, meta["name"])
            objects = self._objects.setdefault(owner, {})
            old = objects.get(key)
            if old is None or version(obj) > version(old):
                objects[key] = obj
                return True
            return False

    def forget(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        with self._lock:
            self._names.discard((kind, meta.get("namespace", ""), meta["name"]))
            owner = owner_of(obj)
            if owner is None:
                return
            objects = self._objects.get(owner, {})
            objects.pop((kind, meta["name"]), None)
            if not objects:
                self._objects.pop(owner, None)

    def may_exist(self, kind: str, namespace: str, name: str) -> bool:
        """False when no object of that kind and name is known in the watched namespaces (the
        index is complete before the first sync, see above)."""
        with self._lock:
            return (kind, namespace, name) in self._names

    def record_deployment(self, body: dict[str, Any]) -> bool:
        """The deployment as its watch or our status patch reported it; whether it was news
        (False for the watch's echo of our own status patch)."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        with self._lock:
            old = self._deployments.get(key)
            if old is None or version(body) > version(old):
                self._deployments[key] = body
                return True
            return False

    def forget_deployment(self, namespace: str, name: str) -> None:
        with self._lock:
            self._deployments.pop((namespace, name), None)

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._deployments.get((namespace, name))

    def _of(self, spec: DeploymentSpec) -> dict[tuple[str, str], dict[str, Any]]:
        with self._lock:
            return dict(self._objects.get((spec.namespace, spec.name), {}))

    def children(self, spec: DeploymentSpec, lws_available: bool) -> Live:
        kinds = {*OWNED_KINDS, *(("LeaderWorkerSet",) if lws_available else ())}
        return {
            key: obj
            for key, obj in self._of(spec).items()
            if key[0] in kinds and owned_by(obj, spec.uid)
        }

    def pods(self, spec: DeploymentSpec) -> list[dict[str, Any]]:
        return [obj for (kind, _), obj in sorted(self._of(spec).items()) if kind == "Pod"]

    def remember(self, result: ApplyResult) -> None:
        for (kind, _), obj in result.seen.items():
            self.record(kind, obj)
        for kind, obj in result.deleted_objects:
            self.forget(kind, obj)
