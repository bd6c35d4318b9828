"""The repository stands alone and its docs are indexed: every page under docs/ is listed in
docs/README.md, and no tracked file points at material outside the repository (a sibling
folder, or notes a clone does not have)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# spelled in pieces so that this file does not match itself; compared in lower case
OUTSIDE = [
    b"shared" + b"/",
    b"design" + b" study",
    b"the" + b" brief",
    b"architecture" + b" notes",
    b"/wo" + b"rk/",  # this workplace's checkout, not a user's clone
]


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (git ls-files failed)")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_every_doc_is_listed_in_the_docs_index() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages - linked == set(), "docs missing from docs/README.md"
    assert linked - pages == set(), "docs/README.md links pages that do not exist"


def test_no_tracked_file_points_outside_the_repository() -> None:
    hits = []
    for path in _tracked():
        if not path.is_file():  # deleted in the work tree, or a submodule
            continue
        data = path.read_bytes().lower()
        hits += [f"{path.relative_to(ROOT)}: {m.decode()!r}" for m in OUTSIDE if m in data]
    assert not hits, "\n".join(hits)


# files the docs name that are not ours: a DeepSeek checkpoint's own encoder
NOT_OURS = {"encoding/encoding_dsv4.py"}


def test_every_file_a_doc_names_exists() -> None:
    """A path in backticks (`engine/core/prefix_hash.py`, `api/spec.py:48`) must end some
    tracked file's path: moves that forget the docs fail here."""
    tracked = [p.relative_to(ROOT).as_posix() for p in _tracked()]
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = re.compile(r"`([\w./-]+\.(?:py|yaml|sh|cpp))(?::\d+)?[`:]")
    stale = [
        f"{doc.relative_to(ROOT)}: {name}"
        for doc in docs
        for name in sorted(set(named.findall(doc.read_text())) - NOT_OURS)
        if not any(t == name or t.endswith("/" + name) for t in tracked)
    ]
    assert not stale, "docs name files that do not exist:\n" + "\n".join(stale)
