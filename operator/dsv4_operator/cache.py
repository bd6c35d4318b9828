"""What the watches report of every managed object (children and engine pods), by deployment, so a
sync reads its children from memory instead of LISTing them: controller-runtime's informer cache,
fed by kopf.

kopf runs no handler until every indexed resource kind has been listed once (its indexes'
pre-population), and ``handlers`` fills this cache from index functions, so a sync never sees a
half-filled cache after a restart. Still, the cache may lag behind the API server for a moment:
``apply_children`` GETs any desired child the cache lacks before creating it, and what a sync
writes is recorded here at once (``remember``), so lag costs a read, never a wrong write.
"""

from __future__ import annotations

import threading
from typing import Any

from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.children import OWNED_KINDS, ApplyResult, Live, owned_by
from dsv4_operator.reconcile import names

Owner = tuple[str, str]  # (namespace, deployment name)


def _version(obj: dict[str, Any]) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion") or 0)
    except ValueError:  # opaque to clients in principle; etcd's are integers
        return 0


class WatchCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # watches write on the event loop, syncs read in threads
        self._objects: dict[Owner, dict[tuple[str, str], dict[str, Any]]] = {}

    @staticmethod
    def _owner(obj: dict[str, Any]) -> Owner | None:
        meta = obj["metadata"]
        owner = (meta.get("labels") or {}).get(names.DEPLOYMENT_LABEL)
        return (meta.get("namespace", ""), owner) if owner else None

    def record(self, kind: str, obj: dict[str, Any]) -> None:
        """An object as a watch (or a write) reported it; an older version never replaces a newer."""
        owner = self._owner(obj)
        if owner is None:
            return
        key = (kind, obj["metadata"]["name"])
        with self._lock:
            objects = self._objects.setdefault(owner, {})
            old = objects.get(key)
            if old is None or _version(obj) >= _version(old):
                objects[key] = obj

    def forget(self, kind: str, obj: dict[str, Any]) -> None:
        owner = self._owner(obj)
        if owner is None:
            return
        with self._lock:
            objects = self._objects.get(owner, {})
            objects.pop((kind, obj["metadata"]["name"]), None)
            if not objects:
                self._objects.pop(owner, None)

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
