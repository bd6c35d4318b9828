"""The CPU budget of processes sharing one host: exact plans from (CPUs, processes, mode), the
exec wrapper that applies a share, and the shares ``dsv4 up`` renders into its commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_common.cli import build_parser
from dsv4_serving.commands import up
from dsv4_serving.platform.share_exec import wrap
from dsv4_serving.platform.threads import (
    ProcessKind,
    ProcessShare,
    cpu_list,
    openmp_runtime,
    parse_cpu_list,
    plan_cpus,
    wait_env,
)

GNU = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}


def _threads_env(n: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n), **GNU}


def _pd(decode: int) -> list[tuple[str, ProcessKind]]:
    """``dsv4 up --decode N``'s processes: one prefill and N decode pairs, the gateway."""
    out: list[tuple[str, ProcessKind]] = []
    for name in ["prefill-0", *(f"decode-{i}" for i in range(decode))]:
        out += [(f"{name}-sidecar", "sidecar"), (name, "engine")]
    return [*out, ("gateway", "gateway")]


def test_three_engines_on_two_cpus_share_them_one_thread_each_unpinned() -> None:
    plan = plan_cpus([0, 1], _pd(2))
    assert plan == [ProcessShare(n, k, 1, None, _threads_env(1)) for n, k in _pd(2)]


def test_two_engines_on_two_cpus_are_pinned_one_cpu_each() -> None:
    plan = {s.name: s for s in plan_cpus([0, 1], _pd(1))}
    assert plan["prefill-0"] == ProcessShare("prefill-0", "engine", 1, (0,), _threads_env(1))
    assert plan["decode-0"] == ProcessShare("decode-0", "engine", 1, (1,), _threads_env(1))
    # the light processes float over every CPU with one thread
    assert plan["gateway"] == ProcessShare("gateway", "gateway", 1, None, _threads_env(1))
    assert plan["decode-0-sidecar"].cpus is None


def test_engines_get_contiguous_slices_of_the_allowed_cpus() -> None:
    cpus = [0, 1, 2, 3, 8, 9, 10, 11]  # a cpuset with a hole
    engines = [s for s in plan_cpus(cpus, _pd(2)) if s.kind == "engine"]
    assert [(s.name, s.threads, s.cpus) for s in engines] == [
        ("prefill-0", 2, (0, 1)),
        ("decode-0", 3, (2, 3, 8)),
        ("decode-1", 3, (9, 10, 11)),
    ]
    assert [s.engine_args() for s in engines] == [
        ["--threads-per-rank", "2"],
        ["--threads-per-rank", "3"],
        ["--threads-per-rank", "3"],
    ]


def test_shared_mode_splits_threads_without_pinning() -> None:
    engines = [s for s in plan_cpus(range(8), _pd(2), "shared") if s.kind == "engine"]
    assert [(s.threads, s.cpus) for s in engines] == [(2, None)] * 3


def test_off_sets_nothing() -> None:
    plan = plan_cpus([0, 1], _pd(2), "off")
    assert plan == [ProcessShare(n, k) for n, k in _pd(2)]
    assert all(s.engine_args() == [] for s in plan)


def test_wait_policy_per_openmp_runtime() -> None:
    assert wait_env("gnu") == GNU
    assert wait_env("intel") == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    assert wait_env("llvm") == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    assert wait_env("unknown") == {**GNU, "KMP_BLOCKTIME": "0"}
    # this venv's torch ships GNU OpenMP (torch.__config__.parallel_info(): OpenMP, libgomp)
    assert openmp_runtime() == "gnu"


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="no CPUs"):
        plan_cpus([], _pd(1))
    with pytest.raises(ValueError, match="must be one of auto, shared, off"):
        plan_cpus([0], _pd(1), "pinned")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad CPU range"):
        parse_cpu_list("3-1")


def test_cpu_list_round_trips_the_kernel_format() -> None:
    assert cpu_list((0, 1, 2, 3, 6, 8, 9)) == "0-3,6,8-9"
    assert parse_cpu_list("0-3,6,8-9") == (0, 1, 2, 3, 6, 8, 9)
    assert cpu_list(None) == ""


def test_share_exec_pins_and_sets_the_environment_before_the_command_runs() -> None:
    cpu = min(os.sched_getaffinity(0))
    share = ProcessShare("x", "engine", 1, (cpu,), {"OMP_NUM_THREADS": "1"})
    probe = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"
    argv = wrap([sys.executable, "-c", probe], share)
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split("\n")[0] == f"[{cpu}] 1"
    assert wrap(["true"], ProcessShare("x", "gateway")) == ["true"]  # no share: as it is


def test_up_renders_each_share_into_its_command(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--decode", "2", "--engine-arg=--threads-per-rank=4"])
    children = {c.name: c for c in up.plan(args, tmp_path)}
    shares = up.cpu_shares(args)
    assert list(shares) == [name for name, _ in _pd(2)]
    for name, child in children.items():
        share = shares[name]
        assert child.argv[: child.argv.index("--")] == wrap([], share)[:-1]
        if share.kind == "engine":
            # the budget's flag comes before the operator's, so the operator's wins
            tail = child.argv[-3:]
            assert tail == ["--threads-per-rank", str(share.threads), "--threads-per-rank=4"]
    off = build_parser().parse_args(["up", "--cpu-budget", "off"])
    assert all("share_exec" not in " ".join(c.argv) for c in up.plan(off, tmp_path))
