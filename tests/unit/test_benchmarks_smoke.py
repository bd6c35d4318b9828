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


def test_prefix_routing_adds_each_variants_flags_to_dsv4_ups_plan(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCHMARKS))  # it imports sessions and charts as the script does
    try:
        bench = load("prefix_routing")
    finally:
        sys.path.remove(str(BENCHMARKS))
    args = bench.parse_args(["--prefill", "1", "--decode", "2", "--host-bytes", "64M"])
    assert args.engine_arg == ["--num-speculative-tokens=0"]
    for variant in ("a", "d"):
        children = up.plan(bench.sessions.stack_args("pd", args, tmp_path), tmp_path)
        bench.configure(children, variant, args.host_bytes)
        gateway, engines = children[-1], [c for c in children[:-1] if "sidecar" not in c.name]
        sidecars = [c for c in children if c.name.endswith("sidecar")]
        events = [
            c.argv[c.argv.index("--kv-events-endpoint") + 1]
            for c in engines
            if "--kv-events-endpoint" in c.argv
        ]
        if variant == "a":
            assert events == [] and gateway.argv[-2:] == ["--policy", "round_robin"]
            assert all("--kv-host-bytes" not in s.argv for s in sidecars)
            continue
        assert len(set(events)) == 3 and gateway.argv[-2:] == ["--prefix-pulls", "on"]
        assert all(s.argv[-2:] == ["--kv-host-bytes", "64M"] for s in sidecars)
        subscribed = [a for a in gateway.argv if a.startswith("http") and "=tcp://" in a]
        assert subscribed == [f"{e.url}={ep}" for e, ep in zip(engines, events, strict=True)]
