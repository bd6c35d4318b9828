"""The import-linter contracts bite: a scratch import of the dev cluster from the operator, in a
copy of the sources, fails `lint-imports` (the dev cluster sits above every runtime package)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "operator", "serving", "kvtransfer", "devcluster")


def test_the_operator_importing_the_dev_cluster_fails_lint(tmp_path: Path) -> None:
    for d in PACKAGES:
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    names = tmp_path / "operator" / "dsv4_operator" / "reconcile" / "names.py"
    names.write_text(names.read_text() + "\nimport dsv4_devcluster  # scratch\n")
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tmp_path / d) for d in PACKAGES)}
    res = subprocess.run(
        [str(lint), "--config", "pyproject.toml", "--no-cache"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0, res.stdout
    assert "dsv4_operator.reconcile.names -> dsv4_devcluster" in res.stdout, res.stdout
