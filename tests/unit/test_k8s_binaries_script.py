"""scripts/k8s-test-binaries: envtest binaries are reused; missing or old Go is one clear error."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "k8s-test-binaries"
ALL = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
]


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60
    )


def _exe(path: Path, body: str = "exit 0") -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def test_kubebuilder_assets_are_used_without_building(tmp_path: Path) -> None:
    assets = tmp_path / "envtest"
    assets.mkdir()
    for b in ALL:
        _exe(assets / b)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "KUBEBUILDER_ASSETS": str(assets),
        "DSV4_CACHE_DIR": str(tmp_path / "cache"),
    }
    res = _run(env)  # no Go on this PATH: anything left to build would fail
    assert res.returncode == 0, res.stderr
    bin_dir = Path(res.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in bin_dir.iterdir()) == sorted(ALL)
    assert (bin_dir / "etcd").resolve() == (assets / "etcd").resolve()
    # second run: nothing to do
    again = _run(env)
    assert again.returncode == 0 and "all binaries present" in again.stderr


def test_missing_go_is_one_clear_error(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "DSV4_CACHE_DIR": str(tmp_path / "cache"),
    }
    if any(Path(d, "go").exists() for d in env["PATH"].split(":")):
        env["PATH"] = str(tmp_path / "empty")
        (tmp_path / "empty").mkdir()
        for tool in ("bash", "mkdir", "sed", "sort", "date", "ln", "cut", "awk", "grep", "dirname"):
            src = next(
                (Path(d, tool) for d in ("/usr/bin", "/bin") if Path(d, tool).exists()), None
            )
            if src:
                os.symlink(src, tmp_path / "empty" / tool)
    res = _run(env)
    assert res.returncode == 1
    assert "Go is not installed" in res.stderr
    assert "KUBEBUILDER_ASSETS" in res.stderr


def test_old_go_is_one_clear_error(tmp_path: Path) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    _exe(fake_bin / "go", "echo go1.20.3")
    env = {
        "PATH": f"{fake_bin}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "DSV4_CACHE_DIR": str(tmp_path / "cache"),
    }
    res = _run(env)
    assert res.returncode == 1
    assert "Go 1.20.3 is too old (need >= 1.26)" in res.stderr


def test_node_binaries_are_what_a_real_node_runs(tmp_path: Path) -> None:
    assets = tmp_path / "envtest"
    assets.mkdir()
    for b in ALL:
        _exe(assets / b)
    env = {
        "PATH": str(tmp_path / "empty"),
        "HOME": str(tmp_path),
        "KUBEBUILDER_ASSETS": str(assets),
        "DSV4_CACHE_DIR": str(tmp_path / "cache"),
    }
    (tmp_path / "empty").mkdir()
    for tool in ("bash", "mkdir", "ln"):
        src = next((Path(d, tool) for d in ("/usr/bin", "/bin") if Path(d, tool).exists()), None)
        if src:
            os.symlink(src, tmp_path / "empty" / tool)
    res = _run(env, "--node")  # the control plane from envtest; the node's binaries need Go
    assert res.returncode == 1
    # (kube-network-policies joins them where the kernel has nftables' queue expression)
    assert "these binaries are missing: kubelet kube-proxy crictl coredns" in res.stderr
