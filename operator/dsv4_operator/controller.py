"""One level-triggered sync of a DeepSeekV4Deployment: observe, apply the children, update status.

Called for every event of the CR or of a child, coalesced per object by ``SyncQueue``; a sync
that changes nothing writes nothing (reads only), so it is safe to run as often as events arrive
and a restarted operator leaves the cluster as it found it. Only a ``ReconcileError`` is a
problem of the deployment (Degraded); any other exception is a bug or an API failure, raised to
the queue, which logs it and retries with back-off.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from prometheus_client import Counter, Histogram

from dsv4_operator.api import KIND
from dsv4_operator.api.spec import ROLES, DeploymentSpec, parse
from dsv4_operator.autoscaling.plan import (
    PlanBook,
    ScalePlan,
    effective_spec,
    instance_index,
    role_scales,
    routing_configmap,
)
from dsv4_operator.children import (
    ApplyResult,
    ChildView,
    ListedChildren,
    Live,
    apply_children,
    owned_by,
)
from dsv4_operator.events import now, post_event
from dsv4_operator.kube import KubeApi
from dsv4_operator.observe import LWS_CRD, observe
from dsv4_operator.queue import Retry
from dsv4_operator.reconcile import ReconcileError, desired_children, names
from dsv4_operator.reconcile.desired import Facts, instance_revisions, kept_children
from dsv4_operator.reconcile.host_access import HostAccess, check_host_access
from dsv4_operator.reconcile.revision import revision
from dsv4_operator.reconcile.status import Observed, compute_status

SYNCS = Counter("dsv4_operator_syncs", "Syncs of a DeepSeekV4Deployment", ["result"])
SYNC_SECONDS = Histogram("dsv4_operator_sync_seconds", "Duration of one sync")
_LWS_TTL_S = 60.0


def _strip_times(status: dict[str, Any]) -> dict[str, Any]:
    out = dict(status)
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in status.get("conditions") or []
    ]
    return out


def _inputs(body: dict[str, Any]) -> tuple[Any, ...]:
    """What a sync reads of the deployment besides its status."""
    meta = body["metadata"]
    return meta.get("generation"), meta.get("labels"), meta.get("deletionTimestamp")


def _pinned(spec: DeploymentSpec, facts: Facts, plan: ScalePlan | None) -> Facts:
    """``facts`` with the instances the autoscaler drains (a rollout leaves them alone)."""
    if plan is None:
        return facts
    pinned = {
        r: frozenset(i for d in plan.draining[r] if (i := instance_index(spec, r, d)) is not None)
        for r in ROLES
    }
    return replace(facts, pinned=pinned)


def _names(keys: list[tuple[str, str]]) -> str:
    return ", ".join(f"{kind} {name}" for kind, name in keys)


def announce(kube: KubeApi, body: dict[str, Any], result: ApplyResult) -> None:
    """One event for what was created and one for what was deleted (none when nothing was)."""
    if result.created:
        post_event(kube, body, "Created", "created " + _names(result.created))
    if result.deleted:
        post_event(kube, body, "Deleted", "deleted " + _names(result.deleted))


def update_status(
    kube: KubeApi,
    body: dict[str, Any],
    spec: DeploymentSpec,
    observed: Observed,
    at: str,
    plan: ScalePlan | None = None,
) -> dict[str, Any] | None:
    """Patch the status subresource when it changed (not for a new timestamp alone), with an
    event when the phase changed; the API server's answer (the deployment with its new status),
    or None when nothing was written."""
    previous = body.get("status") or {}
    status = compute_status(spec, observed, previous, at, plan)
    if _strip_times(status) == _strip_times({k: previous.get(k) for k in status}):
        return None
    meta = body["metadata"]
    written = kube.patch_status(KIND, meta["namespace"], meta["name"], status)
    degraded = status["phase"] == "Degraded"
    detail = _message(status, "Degraded" if degraded else "Ready")
    # a new reason to be Degraded is news too, not only a new phase
    if status["phase"] != previous.get("phase") or (
        degraded and detail != _message(previous, "Degraded")
    ):
        post_event(kube, body, status["phase"], f"phase {status['phase']}: {detail}", degraded)
    return written


def _message(status: dict[str, Any], ctype: str) -> str | None:
    return next(
        (c.get("message") for c in status.get("conditions") or [] if c["type"] == ctype), None
    )


class Controller:
    def __init__(
        self,
        kube: KubeApi,
        view: ChildView | None = None,
        host_access: HostAccess | None = None,
        plans: PlanBook | None = None,
    ) -> None:
        """``view``: where children and pods are read (the operator's watch cache; default a
        LIST per kind); ``host_access``: what of the node deployments may reach (default
        nothing); ``plans``: the autoscaler's instance counts and drains."""
        self.kube = kube
        self.plans = plans or PlanBook()
        self.host_access = host_access or HostAccess()
        self.view = view or ListedChildren(kube)
        self._lws: tuple[float, bool] = (0.0, False)

    def lws_available(self) -> bool:
        """Whether the LeaderWorkerSet CRD is installed (asked at most once a minute; the CRD
        watch calls ``forget_lws`` when it changes)."""
        at, value = self._lws
        if at == 0.0 or time.monotonic() - at > _LWS_TTL_S:
            value = self.kube.crd_exists(LWS_CRD)
            self._lws = (time.monotonic(), value)
        return value

    def forget_lws(self) -> None:
        self._lws = (0.0, False)

    def _read_kv_secret(self, spec: DeploymentSpec, live: Live) -> None:
        """The KV token is kept, never replaced: a Secret missing from ``live`` (a lagging
        cache) is read before a fresh token could be made up for it, even when the name index
        says it is free (one GET per new deployment; a replaced token breaks every transfer)."""
        key = ("Secret", names.kv_secret_name(spec))
        if key not in live:
            secret = self.kube.get(key[0], spec.namespace, key[1])
            if secret is not None and owned_by(secret, spec.uid):
                live[key] = secret

    def sync(self, namespace: str, name: str) -> None:
        start = time.monotonic()
        try:
            self._sync(namespace, name)
            SYNCS.labels("ok").inc()
        except Retry:
            SYNCS.labels("refused").inc()
            raise
        except Exception:
            SYNCS.labels("error").inc()
            raise
        finally:
            SYNC_SECONDS.observe(time.monotonic() - start)

    def _sync(self, namespace: str, name: str) -> None:
        body = self.view.deployment(namespace, name) or self.kube.get(KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # children go with it through their owner references
        spec = parse(body)
        plan = self.plans.plan_for(spec, body.get("status"))
        spec = effective_spec(spec, plan)  # autoscaled: the plan's counts, not spec's
        lws = self.lws_available()
        live = self.view.children(spec, lws)
        self._read_kv_secret(spec, live)
        pods = self.view.pods(spec)
        seen = observe(spec, lws, live, pods)
        observed = seen.observed
        refused: list[str] = []
        try:
            check_host_access(spec, self.host_access)
            facts = _pinned(spec, seen.facts, plan)
            desired = desired_children(spec, facts)
            # every gateway reads it: the draining instances, and each instance's revision
            revisions = instance_revisions(spec, facts)
            desired.append(routing_configmap(spec, plan, revision(spec), revisions))
            if plan is not None and spec.autoscaling.mode == "External":
                desired += role_scales(spec)
        except ReconcileError as e:
            # nothing is applied or pruned while the spec cannot be built
            observed = observed.with_problems([str(e)], e.reason)
        else:
            result = apply_children(
                self.kube, desired, live, spec.uid, self.view.may_exist, kept_children(spec, facts)
            )
            self.view.remember(result)
            announce(self.kube, body, result)
            if result.seen or result.deleted:
                # the status describes the children as this sync left them, so the watch
                # events of its own writes have nothing left to tell (they sync nothing)
                gone = set(result.deleted)
                after = {k: v for k, v in live.items() if k not in gone} | result.seen
                observed = observe(spec, lws, after, pods).observed
            observed = observed.with_problems(result.foreign, "InvalidChild")
            observed = observed.with_problems(result.refused, "ChildRejected")
            refused = result.refused
        written = update_status(self.kube, body, spec, observed, now(), plan)
        if written is not None and _inputs(written) == _inputs(body):
            # recorded, so the watch's echo of this patch syncs nothing; not when someone edited
            # the deployment between our read and our patch: that edit's event must be news
            self.view.record_deployment(written)
        if refused:
            # an admission webhook or quota may change its mind: retried with back-off; an edit
            # of the deployment syncs at once anyway
            raise Retry(f"the API server refused its children: {refused[0]}")
