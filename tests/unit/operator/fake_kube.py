"""An in-memory stand-in for the project's ``KubeApi``: objects by (kind, namespace, name), server
-side apply as a merge that bumps resourceVersion, and every request counted by verb."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from dsv4_operator.kube import KubeError


class FakeKube:
    def __init__(self, crds: tuple[str, ...] = ()) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.calls: Counter[str] = Counter()
        self.crds = set(crds)
        self.reject: dict[tuple[str, str], KubeError] = {}
        """(kind, name) -> the error ``apply`` raises for it."""
        self._version = 0

    def writes(self) -> int:
        return sum(n for verb, n in self.calls.items() if verb not in ("get", "list"))

    def _bump(self, obj: dict[str, Any]) -> None:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as someone else would (not counted)."""
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        self._bump(obj)
        self.objects[(obj["kind"], meta.get("namespace", ""), meta["name"])] = obj
        return obj

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls["get"] += 1
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        self.calls["list"] += 1
        out = []
        for (k, ns, _), obj in sorted(self.objects.items()):
            labels = obj["metadata"].get("labels") or {}
            if (
                k == kind
                and ns == namespace
                and all(labels.get(a) == b for a, b in selector.items())
            ):
                item = copy.deepcopy(obj)
                del item["kind"]  # as in a real List response
                item.pop("apiVersion", None)
                out.append(item)
        return out

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        self.calls["dry_run" if dry_run else "apply"] += 1
        meta = obj["metadata"]
        if (obj["kind"], meta["name"]) in self.reject:
            raise self.reject[(obj["kind"], meta["name"])]
        if dry_run:
            return copy.deepcopy(obj)
        key = (obj["kind"], meta["namespace"], meta["name"])
        old = self.objects.get(key)
        new = copy.deepcopy(obj)
        if old is not None and "status" in old:
            new["status"] = old["status"]
        self._bump(new)
        self.objects[key] = new
        return copy.deepcopy(new)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.calls["delete"] += 1
        self.objects.pop((kind, namespace, name), None)

    def patch_status(
        self, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        self.calls["patch_status"] += 1
        obj = self.objects[(kind, namespace, name)]
        obj["status"] = copy.deepcopy(status)
        self._bump(obj)
        return copy.deepcopy(obj)

    def create(self, obj: dict[str, Any]) -> None:
        self.calls["create"] += 1
        if obj["kind"] == "Event":
            self.events.append(copy.deepcopy(obj))
            return
        self.put(obj)

    def crd_exists(self, name: str) -> bool:
        self.calls["get"] += 1
        return name in self.crds
