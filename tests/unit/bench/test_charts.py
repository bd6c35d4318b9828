"""benchmarks/charts.py writes a real PNG with one line per series."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "charts.py"
_spec = importlib.util.spec_from_file_location("charts", SCRIPT)
assert _spec is not None and _spec.loader is not None
charts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(charts)
line_chart = charts.line_chart


def test_line_chart_writes_a_png(tmp_path: Path) -> None:
    out = line_chart(
        tmp_path / "sub" / "ttft.png",
        "TTFT per turn",
        "turn",
        "seconds",
        {"ours": [(1, 0.2), (2, 0.25)], "peer": [(1, 0.3), (2, 0.6)]},
    )
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # the IHDR chunk: 7 x 4.2 inches at 110 dpi
    assert int.from_bytes(data[16:20], "big") == 770
    assert int.from_bytes(data[20:24], "big") == 462
