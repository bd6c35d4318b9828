"""Every benchmark still starts: a benchmark is a script no other test imports, so it can rot
unnoticed (``chaos.py`` once died at start on a ``dsv4 up`` flag its hand-made namespace lacked).
Parametrised over the scripts of ``benchmarks/`` (a file with a ``__main__`` guard; the others,
e.g. ``autoscaling_analysis.py``, are their modules): a new benchmark is covered by being there. The real run of
``chaos.py`` (it starts ``dsv4 up``) is in ``tests/gateway/test_chaos_smoke.py``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dsv4_serving.commands import up

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """A benchmark script as a module (it is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if '__name__ == "__main__"' in p.read_text())


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_answers_help(path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout


def test_chaos_plans_its_stack_with_dsv4_ups_parser(tmp_path: Path) -> None:
    chaos = load("chaos")
    args = chaos.parse_args(["--prefill", "1", "--decode", "2"])
    stack = chaos.stack_args(args, tmp_path)
    # every flag of `dsv4 up` is there (with its default), whatever flags it gains
    assert stack.otlp_traces_endpoint is None and stack.kv_transport == "tcp"
    assert stack.engine_arg == ["--shutdown-timeout", "10", "--kv-pull-timeout", "10"]
    children = up.plan(stack, tmp_path)
    assert [c.name for c in children] == [
        *("prefill-0-sidecar", "prefill-0"),
        *("decode-0-sidecar", "decode-0", "decode-1-sidecar", "decode-1"),
        "gateway",
    ]
