"""The node tier: a dev cluster with one real node (containerd + runc + kubelet), kube-proxy and
CoreDNS, started once per session. Needs root; without it every test skips with the reason (never
silently). The host state is read before the cluster starts; `test_host_left_clean.py`, run after every
other test (the ``after_the_tier`` marker below), stops the cluster and asserts nothing was
left."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REAL_NODE_SELECTOR = {"dsv4.io/real-node": "true"}
APP_IMAGES = ("engine", "operator")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "after_the_tier(n): run after every other test, n-th (it stops the tier's shared cluster)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``after_the_tier(n)`` stop the session's real node, so they run after
    every other test, in the order of ``n``; the rest keep their order (a stable sort)."""

    def last(item: pytest.Item) -> int:
        mark = item.get_closest_marker("after_the_tier")
        return 0 if mark is None else int(mark.args[0])

    items.sort(key=last)


class RealClusterHandle:
    """Starts on first use; ``close()`` (idempotent) stops it and returns the host-state diff."""

    def __init__(self) -> None:
        from dsv4_devcluster.realnodes import hoststate

        self.before = hoststate.snapshot()
        self._stack: Any = None
        self.cluster: Any = None
        self.real: Any = None
        self.left: dict[str, list[str]] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._app_imported = False
        self.timings: dict[str, float] = {}
        self.notes: dict[str, list[str]] = {}

    def get(self) -> Any:
        import contextlib

        from dsv4_devcluster import ClusterConfig
        from dsv4_devcluster.binaries import (
            cache_root,
            ensure_binaries,
            ensure_node_images,
        )
        from dsv4_devcluster.realnodes.nodes import (
            BASE_IMAGES,
            RealNodes,
            cluster_with_real_nodes,
        )
        from dsv4_devcluster.realnodes.preflight import unavailable_reason

        if self.cluster is not None:
            return self.cluster
        bin_dir = ensure_binaries(node=True)
        reason = unavailable_reason(bin_dir)
        if reason:
            pytest.skip(f"node tier: {reason}")
        layout = ensure_node_images()
        self._tmp = tempfile.TemporaryDirectory(prefix="dsv4-node-")
        work = Path(self._tmp.name)
        # the containerd root is kept in the cache: the engine image is imported once, then
        # each commit's image costs its project layer
        self.real = RealNodes(
            1,
            bin_dir,
            work / "real-nodes",
            images=list(BASE_IMAGES),
            layout=layout,
            containerd_cache=cache_root() / "containerd",
        )
        self._stack = contextlib.ExitStack()
        self.cluster = self._stack.enter_context(
            cluster_with_real_nodes(ClusterConfig(bin_dir=bin_dir, work_dir=work), self.real)
        )
        return self.cluster

    def app_images(self) -> dict[str, str]:
        """Build (cached) and import the engine and operator images; name -> image reference."""
        from dsv4_devcluster.binaries import ensure_node_images

        self.get()
        if not self._app_imported:
            t0 = time.monotonic()
            ensure_node_images(app=True)
            self.timings["build images"] = time.monotonic() - t0
            for name in APP_IMAGES:
                t0 = time.monotonic()
                sent = self.real.import_image(f"dsv4.local/{name}:dev")
                self.timings[f"import {name}"] = time.monotonic() - t0
                self.timings[f"import {name} MB"] = sent / 1e6
            self._app_imported = True
        return {n: f"dsv4.local/{n}:dev" for n in APP_IMAGES}

    def close(self) -> dict[str, list[str]]:
        from dsv4_devcluster.realnodes import hoststate

        if self.left is None:
            if self._stack is not None:
                self._stack.close()
            if self._tmp is not None:
                self._tmp.cleanup()
            self.left = hoststate.diff(self.before, hoststate.snapshot())
        return self.left


@pytest.fixture(scope="session")
def real_handle() -> Iterator[RealClusterHandle]:
    handle = RealClusterHandle()
    try:
        yield handle
    finally:
        left = handle.close()
        # what the tier measured (import times, readiness, what a user saw): -s shows it, and
        # DSV4_NODE_REPORT=path keeps it
        report = json.dumps({"timings": handle.timings, "notes": handle.notes}, indent=1)
        print(f"\nnode tier report: {report}")
        if os.environ.get("DSV4_NODE_REPORT"):
            Path(os.environ["DSV4_NODE_REPORT"]).write_text(report)
        assert not left, f"the node tier left host state behind: {left}"


@pytest.fixture(scope="session")
def real_cluster(real_handle: RealClusterHandle) -> Any:
    """A LocalCluster with one kwok node and one real node `real-0`."""
    return real_handle.get()


@pytest.fixture(scope="session")
def app_images(real_handle: RealClusterHandle) -> dict[str, str]:
    """The engine and operator images, built from docker/*.Dockerfile and imported into the node."""
    return real_handle.app_images()


@pytest.fixture
def real_namespace(real_cluster: Any) -> Iterator[str]:
    import uuid

    name = f"n-{uuid.uuid4().hex[:8]}"
    real_cluster.kubectl("create", "namespace", name)
    # Pods need the namespace's default ServiceAccount.
    deadline = time.monotonic() + 30
    while not real_cluster.kubectl("get", "sa", "default", "-n", name, "--ignore-not-found"):
        assert time.monotonic() < deadline, "no default ServiceAccount"
        time.sleep(0.2)
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def apply(cluster: Any, *objs: dict[str, Any]) -> None:
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
    )


def wait_pod(cluster: Any, ns: str, name: str, cond: str = "Ready", timeout: int = 120) -> None:
    cluster.kubectl(
        "wait", f"--for=condition={cond}", f"--timeout={timeout}s", "-n", ns, f"pod/{name}"
    )


def busybox_pod(name: str, command: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeSelector": REAL_NODE_SELECTOR,
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "main",
                    "image": "dsv4.local/busybox:1",
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", command],
                }
            ],
            **spec,
        },
    }


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def chart_operator(
    real_handle: RealClusterHandle, real_cluster: Any, app_images: dict[str, str]
) -> Iterator[None]:
    """`helm install` of charts/dsv4 with the operator image on the real node (the operator runs
    as a pod, in-cluster config through kube-proxy), once for every deployment of the tier (one
    at a time: each test module deletes its own); the kwok node cordoned meanwhile, so the
    gateway Deployment (no node selector of the deployment's) lands on the real node too."""
    from tests.k8s.conftest import helm

    cluster = real_cluster
    t0 = time.monotonic()
    res = helm(
        cluster,
        "install",
        "dsv4",
        str(REPO / "charts" / "dsv4"),
        "--namespace",
        "dsv4-system",
        "--create-namespace",
        "--set",
        "image.repository=dsv4.local/operator",
        "--set",
        "image.tag=dev",
        "--set-string",
        "nodeSelector.dsv4\\.io/real-node=true",
        "--wait",
        "--timeout=180s",
    )
    assert res.returncode == 0, res.stderr + cluster.kubectl(
        "get", "pods", "-A", "-o", "wide", check=False
    )
    cluster.kubectl("cordon", "ascend-node-0")
    real_handle.timings["operator release installed (s)"] = time.monotonic() - t0
    yield
    # test_host_left_clean.py may have stopped the cluster already, the release with it
    if real_handle.left is None:
        helm(cluster, "uninstall", "dsv4", "--namespace", "dsv4-system", "--wait")
        cluster.kubectl("uncordon", "ascend-node-0", check=False)


@contextlib.contextmanager
def deployment(cluster: Any, cr: dict[str, Any], timeout: float = 420) -> Iterator[None]:
    """A DeepSeekV4Deployment in its own (new) namespace, Ready; the namespace deleted after."""
    ns, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
    cluster.kubectl("create", "namespace", ns)
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(cr))
        deadline = time.monotonic() + timeout
        phase = ""
        while phase != "Ready":
            try:
                phase = cluster.kubectl(
                    "get", "deepseekv4deployment", name, "-n", ns, "-o", "jsonpath={.status.phase}"
                )
            except subprocess.TimeoutExpired:  # a loaded API server: the deadline decides
                phase = ""
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{name} is {phase!r} after {timeout:.0f} s:\n"
                    + cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False)
                    + cluster.kubectl("describe", "pods", "-n", ns, check=False)[-6000:]
                )
            time.sleep(2)
        yield
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        # Teardown, not a drain test (the pod-deletion tests are): a terminating namespace gets
        # no new pods, and a 1 s grace period cuts the preStop pauses and drains (about 60 s).
        cluster.kubectl(
            "delete", "pods", "--all", "-n", ns, "--grace-period=1", "--wait=false", check=False
        )
        deadline = time.monotonic() + 180
        while cluster.kubectl("get", "namespace", ns, "--ignore-not-found", check=False):
            assert time.monotonic() < deadline, f"namespace {ns} not deleted in 180 s"
            time.sleep(1)
