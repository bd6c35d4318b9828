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


def _pulled_in_by() -> dict[str, set[str]]:
    """package -> the packages the lock says pull it in (`dsv4` for the project's extras)."""
    pullers: dict[str, set[str]] = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        name, _, rest = line.partition("==")
        via = rest.partition("# via")[2]
        names = {_norm(v.strip().split(" ")[0]) for v in via.split(",") if v.strip()}
        pullers[_norm(name.strip())] = names
    return pullers


def _requires(package: str, pullers: dict[str, set[str]]) -> set[str]:
    """Every package `package` brings in, directly or through a dependency, per the lock."""
    seen: set[str] = set()
    todo = [package]
    while todo:
        current = todo.pop()
        for name, via in pullers.items():
            if current in via and name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def test_the_production_images_extras_do_not_bring_the_dev_clusters_cryptography() -> None:
    """The operator/gateway image installs `operator` and `gateway`: cryptography (the dev
    cluster's certificates) must come from neither, directly or through a dependency."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pullers = _pulled_in_by()
    assert "cryptography" in {_norm(re.split(r"[<>=!~\[; ]", r)[0]) for r in extras["devcluster"]}
    for extra in ("operator", "gateway"):
        names = {_norm(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in extras[extra]}
        assert "cryptography" not in names, f"the {extra} extra lists cryptography"
        for name in names:
            assert "cryptography" not in _requires(name, pullers), f"{name} brings cryptography"
    # the check can fail: pyjwt (the test extra's openai-agents) does bring it in
    assert "cryptography" in _requires("pyjwt", pullers)
