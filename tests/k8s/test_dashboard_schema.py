"""The chart's Grafana dashboards against Grafana's schema (grafana-foundation-sdk's Go types,
strict decoding + validation, built by scripts/dashboard-check): valid as shipped, and a
dashboard with a mistake in it is refused with the field named."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "dashboard-check"
DASHBOARDS = sorted((ROOT / "charts" / "dsv4" / "dashboards").glob("*.json"))


def _check(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CHECK), *map(str, files)], capture_output=True, text=True, timeout=900
    )


def test_the_shipped_dashboards_are_valid() -> None:
    assert DASHBOARDS
    r = _check(*DASHBOARDS)
    assert r.returncode == 0, r.stdout + r.stderr
    for f in DASHBOARDS:
        panels = len(json.loads(f.read_text())["panels"])
        assert f"{f}: ok ({panels} panels)" in r.stdout


def test_a_broken_dashboard_is_refused(tmp_path: Path) -> None:
    d = json.loads(DASHBOARDS[0].read_text())
    d["panels"][0]["gridPos"]["w"] = "wide"  # a string where Grafana wants a number
    d["panels"][1]["options"]["legend"]["shape"] = "round"  # no such option
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    r = _check(bad)
    assert r.returncode == 1
    assert "panels[0].gridPos.w" in r.stdout, r.stdout
    assert "panels[1].options.legend" in r.stdout, r.stdout
