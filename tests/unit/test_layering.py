"""Layering that import-linter cannot see: benchmarks are scripts outside the packages, so this
reads their source. A benchmark imports installed packages only: never ``tests`` (test helpers
shared with a benchmark belong in a package) and never a ``sys.path`` edit to reach one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))


def violations(source: str) -> list[str]:
    """What in ``source`` reaches into ``tests`` or edits the import path, with line numbers."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        if isinstance(node, ast.Import | ast.ImportFrom):
            found += [(node.lineno, f"imports {m}") for m in modules if m.split(".")[0] == "tests"]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            found.append((node.lineno, "uses sys.path"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_the_check_finds_test_imports_and_path_edits() -> None:
    source = "import sys\nsys.path.insert(0, '.')\nfrom tests.gateway import x\nimport tests.k8s\n"
    assert violations(source) == [
        "line 2: uses sys.path",
        "line 3: imports tests.gateway",
        "line 4: imports tests.k8s",
    ]
    assert violations("from dsv4_common.process import Service\nimport sys\nsys.exit(0)\n") == []


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_a_benchmark_imports_no_test_code(path: Path) -> None:
    assert violations(path.read_text()) == []
