"""One level-triggered sync of a DeepSeekV4Deployment: observe, compute, apply, prune, report.

Called for every event of the CR or of a child, coalesced per object by ``SyncQueue``; a sync
that changes nothing writes nothing, so it is safe to run as often as events arrive and a
restarted operator leaves the cluster as it found it.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import replace
from typing import Any

from prometheus_client import Counter, Histogram

from dsv4_operator.api import KIND
from dsv4_operator.api.spec import parse
from dsv4_operator.kube import Kube, KubeError
from dsv4_operator.observe import LWS_CRD, observe
from dsv4_operator.reconcile import desired_children, names
from dsv4_operator.reconcile.status import compute_status

log = logging.getLogger("dsv4.operator")

SYNCS = Counter("dsv4_operator_syncs", "Syncs of a DeepSeekV4Deployment", ["result"])
SYNC_SECONDS = Histogram("dsv4_operator_sync_seconds", "Duration of one sync")
APPLIED = Counter("dsv4_operator_children_created", "Child objects created", ["kind"])
PRUNED = Counter("dsv4_operator_children_deleted", "Child objects deleted", ["kind"])

# Kinds the operator owns and prunes (LeaderWorkerSet only when its CRD exists).
OWNED_KINDS = (
    "ConfigMap",
    "Secret",
    "Service",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "StatefulSet",
    "Deployment",
    "PodDisruptionBudget",
    "NetworkPolicy",
)
_LWS_TTL_S = 60.0


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _strip_times(status: dict[str, Any]) -> dict[str, Any]:
    out = dict(status)
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in status.get("conditions") or []
    ]
    return out


class Controller:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._lws: tuple[float, bool] = (0.0, False)

    def lws_available(self) -> bool:
        at, value = self._lws
        if time.monotonic() - at > _LWS_TTL_S:
            value = self.kube.crd_exists(LWS_CRD)
            self._lws = (time.monotonic(), value)
        return value

    def forget_lws(self) -> None:
        self._lws = (0.0, False)

    def event(self, body: dict[str, Any], reason: str, message: str, warning: bool = False) -> None:
        meta = body["metadata"]
        ts = _now()
        try:
            self.kube.create(
                {
                    "apiVersion": "v1",
                    "kind": "Event",
                    "metadata": {
                        "generateName": f"{meta['name']}.",
                        "namespace": meta["namespace"],
                    },
                    "involvedObject": {
                        "apiVersion": body["apiVersion"],
                        "kind": KIND,
                        "name": meta["name"],
                        "namespace": meta["namespace"],
                        "uid": meta["uid"],
                    },
                    "type": "Warning" if warning else "Normal",
                    "reason": reason,
                    "message": message[:1000],
                    "source": {"component": names.MANAGER},
                    "firstTimestamp": ts,
                    "lastTimestamp": ts,
                    "count": 1,
                }
            )
        except KubeError as e:  # events are best effort
            log.warning("could not post event %s: %s", reason, e)

    def sync(self, namespace: str, name: str) -> None:
        start = time.monotonic()
        try:
            self._sync(namespace, name)
            SYNCS.labels("ok").inc()
        except Exception:
            SYNCS.labels("error").inc()
            raise
        finally:
            SYNC_SECONDS.observe(time.monotonic() - start)

    def _sync(self, namespace: str, name: str) -> None:
        body = self.kube.get(KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # children go with it through their owner references
        spec = parse(body)
        lws = self.lws_available()
        snap = observe(self.kube, spec, lws)
        observed = snap.observed
        try:
            desired = desired_children(spec, snap.facts)
        except ValueError as e:
            desired = []
            observed = replace(
                observed, problems=[str(e), *observed.problems], problem_reason="InvalidSpec"
            )

        if desired:
            existing = self._existing(spec.namespace, spec.name, spec.uid, lws)
            wanted = {(o["kind"], o["metadata"]["name"]) for o in desired}
            created, rejected = [], []
            for obj in desired:
                key = (obj["kind"], obj["metadata"]["name"])
                if key not in existing and self._foreign(obj):
                    # never adopt (and later prune) an object someone else made under our name
                    rejected.append(
                        f"{key[0]} {key[1]} already exists and is not owned by this DeepSeekV4Deployment"
                    )
                    continue
                try:
                    self.kube.apply(obj)
                except KubeError as e:
                    if e.status not in (400, 403, 409, 422):
                        raise
                    rejected.append(f"{key[0]} {key[1]} rejected: {e.message}")
                    continue
                if key not in existing:
                    created.append(key)
                    APPLIED.labels(key[0]).inc()
            deleted = []
            for key in sorted(existing - wanted):
                self.kube.delete(key[0], spec.namespace, key[1])
                deleted.append(key)
                PRUNED.labels(key[0]).inc()
            if created:
                self.event(body, "Created", "created " + ", ".join(f"{k} {n}" for k, n in created))
            if deleted:
                self.event(body, "Deleted", "deleted " + ", ".join(f"{k} {n}" for k, n in deleted))
            if rejected:
                observed = replace(
                    observed, problems=rejected + observed.problems, problem_reason="InvalidChild"
                )

        previous = body.get("status") or {}
        status = compute_status(spec, observed, previous, _now())
        if _strip_times(status) != _strip_times({k: previous.get(k) for k in status}):
            self.kube.patch_status(KIND, namespace, name, status)
            if status["phase"] != previous.get("phase"):
                degraded = status["phase"] == "Degraded"
                detail = next(
                    c["message"]
                    for c in status["conditions"]
                    if c["type"] == ("Degraded" if degraded else "Ready")
                )
                self.event(
                    body, status["phase"], f"phase {status['phase']}: {detail}", warning=degraded
                )

    def _foreign(self, obj: dict[str, Any]) -> bool:
        """Whether an object of that kind and name exists without our controller reference."""
        meta = obj["metadata"]
        current = self.kube.get(obj["kind"], meta["namespace"], meta["name"])
        if current is None:
            return False
        ours = meta["ownerReferences"][0]["uid"]
        refs = current["metadata"].get("ownerReferences") or []
        return not any(r.get("uid") == ours for r in refs)

    def _existing(self, namespace: str, name: str, uid: str, lws: bool) -> set[tuple[str, str]]:
        """Children of this CR that exist now (owned by its uid, so a same-named successor is safe)."""
        sel = {names.DEPLOYMENT_LABEL: name, "app.kubernetes.io/managed-by": names.MANAGER}
        out = set()
        for kind in (*OWNED_KINDS, *(("LeaderWorkerSet",) if lws else ())):
            for obj in self.kube.list(kind, namespace, sel):
                refs = obj["metadata"].get("ownerReferences") or []
                if any(r.get("uid") == uid for r in refs):
                    out.add((kind, obj["metadata"]["name"]))
        return out
