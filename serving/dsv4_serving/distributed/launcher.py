"""The local ranks of an engine instance as spawned processes, watched and stopped together.

Each rank is a ``spawn`` child (its own torch state and threads) that dies with its parent
(Linux parent-death signal, as ``dsv4_common.process`` children do), so a killed front end
leaves no rank behind. ``first_dead`` is the sentinel check the front end runs while it reads
the core's messages: any rank that exits ends the instance, and ``kill`` takes the rest down.
Each rank carries its name in the kernel (``ps`` shows ``dsv4-rank-1``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dsv4_common.process import die_with_parent

_PR_SET_NAME = 15


def _name_process(name: str) -> None:
    # the kernel's name of the process (ps, top, /proc/PID/comm): which rank is which
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15])


def _rank_entry(target: Callable[..., object], name: str, args: tuple[Any, ...]) -> None:
    # The front end drains on SIGTERM and then stops its ranks itself (a Shutdown message, then
    # a kill); a signal to the whole process group (Ctrl-C, a supervisor that signals the group,
    # tini -g) must not kill the ranks under the requests it is draining.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    _name_process(name)
    target(*args)
    # The rank has cleaned up (its process groups destroyed): run Python's exit handlers (queue
    # feeders, span exporters, logging), then skip the native teardown, whose static
    # destructors abort ("terminate called without an active exception", exit -6) when a thread
    # of the collective library outlives its peers' stop, as a rank on another node saw.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LocalRanks:
    """``target(*args[i])`` in process ``i``, started at construction."""

    def __init__(
        self,
        target: Callable[..., object],
        args: Sequence[tuple[Any, ...]],
        name: str,
        first: int = 0,
    ) -> None:
        """``first``: the global rank of process 0 (the names carry global ranks)."""
        ctx = mp.get_context("spawn")
        n = len(args)
        names = [name] if n == 1 and not first else [f"{name}-{first + i}" for i in range(n)]
        self.procs = [
            ctx.Process(target=_rank_entry, args=(target, n, a), daemon=True, name=n)
            for n, a in zip(names, args, strict=True)
        ]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def first_dead(self) -> tuple[int, int | None] | None:
        """(local rank, exit code) of the first rank that has exited, if any."""
        for i, p in enumerate(self.procs):
            if not p.is_alive():
                return i, p.exitcode
        return None

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every rank to exit; then kill the ones left."""
        import time

        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
