"""A thin, typed layer over the Kubernetes REST API: server-side apply, list, delete, status.

Uses the ``kubernetes`` client's ApiClient for auth and transport, with explicit resource paths so
the operator needs no discovery round-trips.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from kubernetes import client, config
from prometheus_client import Counter

from dsv4_operator.api import GROUP, PLURAL, VERSION

FIELD_MANAGER = "dsv4-operator"
API_REQUESTS = Counter(
    "dsv4_operator_api_requests", "Requests to the Kubernetes API, by verb", ["verb"]
)


@dataclass(frozen=True)
class ResourceKind:
    api_version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        p = (
            f"{base}/namespaces/{namespace}/{self.plural}"
            if self.namespaced
            else f"{base}/{self.plural}"
        )
        if name:
            p += f"/{name}"
        if sub:
            p += f"/{sub}"
        return p


KINDS: dict[str, ResourceKind] = {
    "ConfigMap": ResourceKind("v1", "configmaps"),
    "Secret": ResourceKind("v1", "secrets"),
    "Service": ResourceKind("v1", "services"),
    "ServiceAccount": ResourceKind("v1", "serviceaccounts"),
    "Pod": ResourceKind("v1", "pods"),
    "Event": ResourceKind("v1", "events"),
    "StatefulSet": ResourceKind("apps/v1", "statefulsets"),
    "Deployment": ResourceKind("apps/v1", "deployments"),
    "Role": ResourceKind("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ResourceKind("rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": ResourceKind("policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ResourceKind("networking.k8s.io/v1", "networkpolicies"),
    "LeaderWorkerSet": ResourceKind("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "DeepSeekV4Deployment": ResourceKind(f"{GROUP}/{VERSION}", PLURAL),
    "DeepSeekV4RoleScale": ResourceKind(f"{GROUP}/{VERSION}", "deepseekv4rolescales"),
    # kopf's peering objects: the autoscaler runs only in the replica kopf lets run
    "KopfPeering": ResourceKind("kopf.dev/v1", "kopfpeerings"),
    "ClusterKopfPeering": ResourceKind("kopf.dev/v1", "clusterkopfpeerings", namespaced=False),
}


class KubeError(RuntimeError):
    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        causes: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.causes = causes or []
        """(field, message) for each field the API server named (``details.causes``)."""


def load_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (or $KUBECONFIG)."""
    if kubeconfig is None:
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            return client.ApiClient()
        except config.ConfigException:
            pass
    api: client.ApiClient = config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    return api


class KubeApi(Protocol):
    """What a sync needs from the API server; ``Kube`` talks to one, tests use an in-memory fake."""

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]: ...

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]: ...

    def delete(self, kind: str, namespace: str, name: str) -> None: ...

    def patch_status(
        self, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]: ...

    def create(self, obj: dict[str, Any]) -> None: ...

    def crd_exists(self, name: str) -> bool: ...


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def _call(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        m, url, headers, payload, _ = self.api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        API_REQUESTS.labels(verb).inc()
        resp = self.api.call_api(m, url, header_params=headers, body=payload, _request_timeout=30)
        data: bytes = resp.read()  # type: ignore[no-untyped-call]
        if not 200 <= resp.status < 300:
            try:
                detail = json.loads(data or b"{}")
            except json.JSONDecodeError:
                detail = {}
            causes = (detail.get("details") or {}).get("causes") or []
            raise KubeError(
                resp.status,
                detail.get("reason", str(resp.reason)),
                detail.get("message", (data or b"").decode(errors="replace")),
                [(c.get("field", ""), c.get("message", "")) for c in causes],
            )
        return json.loads(data) if data else None

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self._call("get", "GET", KINDS[kind].path(namespace, name))
            return obj
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        sel = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        res = self._call("list", "GET", KINDS[kind].path(namespace), query=[("labelSelector", sel)])
        items: list[dict[str, Any]] = res.get("items") or []
        return items

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply under the operator's field manager; force takes ownership back from
        anyone who edited a field we own (that is how drift is corrected). ``dry_run``: validated
        and admitted as a real apply would be, nothing stored."""
        meta = obj["metadata"]
        path = KINDS[obj["kind"]].path(meta["namespace"], meta["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        res: dict[str, Any] = self._call(
            "dry_run" if dry_run else "apply",
            "PATCH",
            path,
            body=obj,
            query=[*query, ("dryRun", "All")] if dry_run else query,
            content_type="application/apply-patch+yaml",
        )
        return res

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self._call(
                "delete",
                "DELETE",
                KINDS[kind].path(namespace, name),
                body={"propagationPolicy": "Background"},
            )
        except KubeError as e:
            if e.status != 404:
                raise

    def patch_status(
        self, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """The object as written (its new resourceVersion lets the watch's echo be ignored)."""
        res: dict[str, Any] = self._call(
            "patch_status",
            "PATCH",
            KINDS[kind].path(namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )
        return res

    def merge_patch(self, kind: str, namespace: str, name: str, body: dict[str, Any]) -> None:
        """A JSON merge patch of the object itself (kopf's peering objects have no status
        subresource: their status is patched this way)."""
        self._call(
            "merge_patch",
            "PATCH",
            KINDS[kind].path(namespace, name),
            body=body,
            content_type="application/merge-patch+json",
        )

    def create(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self._call("create", "POST", KINDS[obj["kind"]].path(meta["namespace"]), body=obj)

    def crd_exists(self, name: str) -> bool:
        try:
            self._call(
                "get", "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
            )
            return True
        except KubeError as e:
            if e.status in (403, 404):
                return False
            raise
