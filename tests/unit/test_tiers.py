"""Every test directory is a tier that `make test` collects (pytest's defaults skip `dist/`)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest

from tests.conftest import TIERS

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_directory_is_a_tier_and_a_marker() -> None:
    dirs = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.rglob("test_*.py"))}
    assert dirs == set(TIERS)
    pyproject = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    markers = {m.split(":")[0] for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    assert set(TIERS) <= markers


def test_no_tier_directory_is_skipped_by_collection() -> None:
    options = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]
    skipped = options["ini_options"]["norecursedirs"]
    assert not [t for t in TIERS for pattern in skipped if fnmatch.fnmatch(t, pattern)]
