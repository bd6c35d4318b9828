"""``benchmarks/chaos.py`` runs end to end, at its smallest: ``dsv4 up`` with one prefill and one
decode engine (and their sidecars), 8 requests, one seeded kill (seed 4: the prefill sidecar,
0.08 s into the load, well before 8 answers of 32 tokens are done however fast the engines are) and
its restart. Its report says nothing hung and nothing leaked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CHAOS = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def test_chaos_smallest_run_reports_no_hang_and_no_leak(tmp_path: Path) -> None:
    flags = ["--prefill", "1", "--decode", "1", "--requests", "8", "--concurrency", "2"]
    flags += ["--output-len", "32"]
    flags += ["--kill-every", "0.3", "--max-kills", "1", "--seed", "4", "--down", "0.5"]
    flags += ["--duration", "120", "--hung-s", "60", "--settle", "30", "--log-dir", str(tmp_path)]
    res = subprocess.run(
        [sys.executable, str(CHAOS), *flags], capture_output=True, text=True, timeout=600
    )
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "== chaos soak ==" in out
    assert re.search(r"^processes killed: +1 ", out, re.M), out
    assert re.search(r"^requests sent: +8$", out, re.M), out
    assert re.search(r"^ +hung: +0 ", out, re.M), out
    leaked = re.findall(r"^leaked .*: (\S+) ", out, re.M)
    assert len(leaked) == 4 and set(leaked) == {"0"}, out  # 2 engines, 2 sidecars


def test_chaos_drain_scenario_moves_streams_without_failing_one(tmp_path: Path) -> None:
    """``--scenario drain``: 1 prefill + 2 decode engines, 4 streams, the busier decode drained
    once they are under way: nothing fails, the report has the drain's duration."""
    flags = ["--scenario", "drain", "--prefill", "1", "--decode", "2", "--streams", "4"]
    flags += [
        "--output-len",
        "96",
        "--move-after",
        "3",
        "--hung-s",
        "120",
        "--log-dir",
        str(tmp_path),
    ]
    res = subprocess.run(
        [sys.executable, str(CHAOS), *flags], capture_output=True, text=True, timeout=600
    )
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert re.search(r"^  failed: +0 ", out, re.M) and re.search(r"^  cut: +0 ", out, re.M), out
    assert re.search(r"^drain duration: +\d", out, re.M), out
    assert re.search(r"^tokens recomputed: +0 ", out, re.M), out  # moved with their KV
