"""CPU budgets of processes that share one host (``dsv4 up``): pure, from (CPUs, processes, mode).

Each engine runs torch's OpenMP pool; left alone, every engine sizes it to all the host's CPUs
and its idle workers spin (OpenMP's active wait) between parallel regions, so three engines on
two cores fight for them. The plan gives each engine an explicit thread count (torch intra-op
threads through ``--threads-per-rank``, ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``), turns the
active wait off (``OMP_WAIT_POLICY=PASSIVE`` plus the runtime's own knob: ``GOMP_SPINCOUNT`` for
GNU OpenMP, ``KMP_BLOCKTIME`` for Intel's and LLVM's), and, when every engine can have at least
one CPU of its own, pins each to a disjoint CPU set. Sidecars and the gateway do no parallel
compute: one thread each, never pinned (they float over all CPUs, mostly asleep in I/O).

torch's inter-op pool is not set: the engine never starts it (no ``torch.jit.fork``), so its
size changes no thread count (measured: an engine core's process holds its main thread, its
queue's feeder thread and the intra-op workers).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ProcessKind = Literal["engine", "sidecar", "gateway"]
BudgetMode = Literal["auto", "shared", "off"]
"""``auto``: pin each engine to its own CPUs when there are at least as many CPUs as engines,
else ``shared``; ``shared``: thread counts and passive wait, no pinning; ``off``: nothing set
(each process sizes its own pool to the whole host)."""
MODES: tuple[BudgetMode, ...] = ("auto", "shared", "off")
OpenMPRuntime = Literal["gnu", "intel", "llvm", "unknown"]


@dataclass(frozen=True, slots=True)
class ProcessShare:
    """One process's share: ``threads`` (None: not set), the CPUs it is pinned to (None: not
    pinned) and the environment that carries the thread count and wait policy."""

    name: str
    kind: ProcessKind
    threads: int | None = None
    cpus: tuple[int, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)

    def engine_args(self) -> list[str]:
        """The engine flags of this share (engines only; an operator's later flag wins)."""
        if self.kind != "engine" or self.threads is None:
            return []
        return ["--threads-per-rank", str(self.threads)]

    def describe(self) -> str:
        if self.threads is None:
            return f"{self.name}: no CPU budget (the process's own defaults)"
        where = f"pinned to CPUs {cpu_list(self.cpus)}" if self.cpus else "not pinned"
        return f"{self.name}: {self.threads} thread{'s' * (self.threads > 1)}, {where}"


def wait_env(runtime: OpenMPRuntime) -> dict[str, str]:
    """OpenMP's active wait off: the standard variable and the runtime's own (both when the
    runtime is not known)."""
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    if runtime in ("gnu", "unknown"):
        env["GOMP_SPINCOUNT"] = "0"
    if runtime in ("intel", "llvm", "unknown"):
        env["KMP_BLOCKTIME"] = "0"
    return env


def plan_cpus(
    cpus: Sequence[int],
    processes: Sequence[tuple[str, ProcessKind]],
    mode: BudgetMode = "auto",
    runtime: OpenMPRuntime = "gnu",
) -> list[ProcessShare]:
    """The share of each of ``processes`` (name, kind), in their order, on ``cpus`` (the CPU
    ids this host lets us use). Engines get contiguous slices of ``cpus`` whose sizes differ by
    one at most when pinned, ``len(cpus) // engines`` threads (at least one) when not."""
    if not cpus:
        raise ValueError("no CPUs to plan over")
    if mode not in MODES:
        raise ValueError(f"CPU budget mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return [ProcessShare(name, kind) for name, kind in processes]
    engines = [name for name, kind in processes if kind == "engine"]
    n, e = len(cpus), max(1, len(engines))
    pinned = mode == "auto" and n >= e
    slices = {name: tuple(cpus[i * n // e : (i + 1) * n // e]) for i, name in enumerate(engines)}
    shares = []
    for name, kind in processes:
        if kind == "engine":
            own = slices[name] if pinned else None
            threads = len(own) if own else max(1, n // e)
        else:
            own, threads = None, 1
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        shares.append(ProcessShare(name, kind, threads, own, {**env, **wait_env(runtime)}))
    return shares


def cpu_list(cpus: Sequence[int] | None) -> str:
    """``0-3,6``: the kernel's cpulist format (``Cpus_allowed_list``, ``taskset -c``)."""
    if not cpus:
        return ""
    ids = sorted(set(cpus))
    runs: list[str] = []
    start = prev = ids[0]
    for c in [*ids[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(runs)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The inverse of ``cpu_list``; a ``ValueError`` for anything else."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        out += range(first, last + 1)
    return tuple(out)


def openmp_runtime() -> OpenMPRuntime:
    """The OpenMP runtime torch ships, by its library's file name (without importing torch):
    ``libgomp`` (GNU), ``libiomp5`` (Intel) or ``libomp`` (LLVM)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "unknown"
    libs = [p.name for d in spec.submodule_search_locations for p in (Path(d) / "lib").glob("*")]
    for prefix, runtime in _RUNTIME_LIBS:
        if any(name.startswith(prefix) for name in libs):
            return runtime
    return "unknown"


_RUNTIME_LIBS: tuple[tuple[str, OpenMPRuntime], ...] = (
    ("libgomp", "gnu"),
    ("libiomp5", "intel"),
    ("libomp", "llvm"),
)
