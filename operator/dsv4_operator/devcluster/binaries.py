"""Where the control-plane binaries are: built (once, cached) by scripts/k8s-test-binaries."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# operator/dsv4_operator/devcluster/binaries.py -> the repository root.
_REPO_ROOT = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = _REPO_ROOT / "scripts" / "k8s-test-binaries"


class BinariesError(RuntimeError):
    pass


def ensure_binaries() -> Path:
    """The bin directory: ``DSV4_K8S_BIN_DIR`` if set, else the build script's (cached) output."""
    explicit = os.environ.get("DSV4_K8S_BIN_DIR")
    if explicit:
        return Path(explicit)
    if not BUILD_SCRIPT.exists():
        raise BinariesError(
            f"{BUILD_SCRIPT} not found (dsv4 is not installed from a source checkout): "
            "set DSV4_K8S_BIN_DIR to a directory holding etcd, kube-apiserver, kubectl, "
            "kube-controller-manager, kube-scheduler, kwok and helm"
        )
    res = subprocess.run([str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise BinariesError(
            f"{BUILD_SCRIPT} failed with status {res.returncode} (its errors are above)"
        )
    lines = res.stdout.strip().splitlines()
    if not lines:
        raise BinariesError(f"{BUILD_SCRIPT} printed no bin directory")
    return Path(lines[-1])
