"""Shared fixtures. Each test directory is one tier; its marker is applied here."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

TIERS = ("unit", "model", "dist", "engine", "pd", "gateway", "k8s", "node")
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.path)).relative_to(_HERE).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


# ---- the k8s tier: a real control plane, started once per session, only when asked for ----------


class _ClusterHandle:
    def __init__(self) -> None:
        self.cluster = None  # type: ignore[var-annotated]
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def get(self):  # type: ignore[no-untyped-def]
        from dsv4_devcluster import ClusterConfig, LocalCluster
        from dsv4_devcluster.binaries import ensure_binaries

        if self.cluster is None:
            keep = os.environ.get("DSV4_K8S_KEEP_DIR")
            work = Path(keep) if keep else Path(self._new_tmp())
            self.cluster = LocalCluster(ClusterConfig(bin_dir=ensure_binaries(), work_dir=work))
            self.cluster.start()
        return self.cluster

    def _new_tmp(self) -> str:
        self._tmp = tempfile.TemporaryDirectory(prefix="dsv4-k8s-")
        return self._tmp.name

    def failure_report(self) -> str:
        return self.cluster.logs(lines=15) if self.cluster is not None else ""

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


@pytest.fixture(scope="session")
def _cluster_handle() -> Iterator[_ClusterHandle]:
    handle = _ClusterHandle()
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(scope="session")
def k8s_control_plane(_cluster_handle: _ClusterHandle):  # type: ignore[no-untyped-def]
    """etcd + kube-apiserver on 127.0.0.1 with TLS, RBAC and an admin kubeconfig."""
    return _cluster_handle.get()


FAKE_NODES = 2


@pytest.fixture(scope="session")
def k8s_cluster(_cluster_handle: _ClusterHandle):  # type: ignore[no-untyped-def]
    """The control plane plus controller manager, scheduler and kwok with fake Ascend nodes."""
    cluster = _cluster_handle.get()
    cluster.start_workloads(FAKE_NODES)
    return cluster


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, None, None]:
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    # funcargs holds every fixture set up for the test, the indirect ones included; any of them
    # that can explain a failure (the control plane, the operator process) adds its logs.
    for name, value in getattr(item, "funcargs", {}).items():
        explain = getattr(value, "failure_report", None)
        if callable(explain):
            text = explain()
            if text:
                report.sections.append((f"{name} logs", text))
