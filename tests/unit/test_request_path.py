"""docs/request-path.md stays true: every function it names exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "request-path.md"
REF = re.compile(r"`(dsv4_[a-z_]+(?:\.[a-z_0-9]+)*)(?::([A-Za-z_][\w.]*))?`")


def refs() -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in REF.finditer(DOC.read_text())]


def test_every_step_is_listed_once() -> None:
    steps = [int(m.group(1)) for m in re.finditer(r"^\| (\d+) \|", DOC.read_text(), re.M)]
    assert steps == list(range(1, 58))


def test_every_named_function_exists() -> None:
    found = refs()
    assert len(found) > 60
    missing = []
    for module, name in found:
        try:
            obj = importlib.import_module(module)
            for part in (name or "").split(".") if name else []:
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{module}:{name} ({exc})")
    assert not missing, "\n".join(missing)
