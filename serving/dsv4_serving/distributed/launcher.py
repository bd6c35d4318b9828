"""The local ranks of an engine instance as spawned processes, watched and stopped together.

Each rank is a ``spawn`` child (its own torch state and threads) that dies with its parent
(Linux parent-death signal, as ``dsv4_common.process`` children do), so a killed front end
leaves no rank behind. ``first_dead`` is the sentinel check the front end runs while it reads
the core's messages: any rank that exits ends the instance, and ``kill`` takes the rest down.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from typing import Any

from dsv4_common.process import _die_with_parent


def _rank_entry(target: Callable[..., None], args: tuple[Any, ...]) -> None:
    _die_with_parent()
    target(*args)


class LocalRanks:
    """``target(*args[i])`` in process ``i``, started at construction."""

    def __init__(
        self, target: Callable[..., None], args: Sequence[tuple[Any, ...]], name: str
    ) -> None:
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=_rank_entry,
                args=(target, a),
                daemon=True,
                name=name if len(args) == 1 else f"{name}-{i}",
            )
            for i, a in enumerate(args)
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
