"""Where the control-plane binaries are: built (once, cached) by scripts/k8s-test-binaries."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# devcluster/dsv4_devcluster/binaries.py -> the repository root.
_REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = _REPO_ROOT / "scripts" / "k8s-test-binaries"
IMAGES_SCRIPT = _REPO_ROOT / "scripts" / "node-images"


class BinariesError(RuntimeError):
    pass


def cache_root() -> Path:
    """Where the scripts cache what they build (``DSV4_CACHE_DIR``, default ~/.cache/dsv4)."""
    return Path(os.environ.get("DSV4_CACHE_DIR") or Path.home() / ".cache" / "dsv4")


def ensure_binaries(node: bool = False) -> Path:
    """The bin directory: ``DSV4_K8S_BIN_DIR`` if set, else the build script's (cached) output;
    ``node`` adds what real nodes run (kubelet, kube-proxy, crictl, coredns)."""
    explicit = os.environ.get("DSV4_K8S_BIN_DIR")
    if explicit:
        return Path(explicit)
    if not BUILD_SCRIPT.exists():
        raise BinariesError(
            f"{BUILD_SCRIPT} not found (dsv4 is not installed from a source checkout): "
            "set DSV4_K8S_BIN_DIR to a directory holding etcd, kube-apiserver, kubectl, "
            "kube-controller-manager, kube-scheduler, kwok and helm"
        )
    return _last_line([str(BUILD_SCRIPT), *(["--node"] if node else [])])


def ensure_node_images(app: bool = False) -> Path:
    """The OCI image layout of the node images (pause, busybox; ``app``: engine, operator), built
    (cached) by scripts/node-images."""
    if not IMAGES_SCRIPT.exists():
        raise BinariesError(f"{IMAGES_SCRIPT} not found: real nodes need a source checkout")
    return _last_line([str(IMAGES_SCRIPT), *(["--app"] if app else [])])


def _last_line(argv: list[str]) -> Path:
    res = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise BinariesError(f"{argv[0]} failed with status {res.returncode} (its errors are above)")
    lines = res.stdout.strip().splitlines()
    if not lines:
        raise BinariesError(f"{argv[0]} printed no directory")
    return Path(lines[-1])
