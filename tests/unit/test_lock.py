"""requirements.lock pins every package pyproject.toml asks for (``make lock`` refreshes it)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"requirements.lock: {line!r} is not pinned with =="
            pins[_norm(name)] = version
    return pins


def test_every_dependency_of_every_extra_is_pinned() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted += extra
    pins = _pins()
    missing = sorted(
        {_norm(re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0]) for req in wanted} - set(pins)
    )
    assert not missing, f"not in requirements.lock (run `make lock`): {missing}"


def test_the_makefile_installs_from_the_lock_without_resolving_the_project() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -r $(LOCK)" in makefile
    assert "pip install --no-deps -e ." in makefile
