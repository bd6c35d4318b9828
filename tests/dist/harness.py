"""``run_ranks``: run a function as ``world`` spawned ranks and collect what each returns.

Each rank gets ``(rank, world, port, *args)`` with one torch thread; the function joins the
process group itself (so failures of the rendezvous can be tested too). Per-rank tracebacks
come back through a queue; when a rank fails the others get a short grace to fail too (a
collective with a dead peer errors out or waits), then every straggler is killed and the test
fails with all tracebacks.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from dsv4_common.process import free_port

GRACE_S = 5.0
# a shared 2-core runner under a full test run is 2-3x slower than an idle one
LOADED_RUNNER = 3.0


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, port: int, out: Any, args: tuple[Any, ...]
) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        out.put((rank, True, fn(rank, world, port, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any], world: int, timeout: float = 90.0, args: tuple[Any, ...] = ()
) -> list[Any]:
    """What each rank's ``fn`` returned, by rank; raises AssertionError naming every failure.
    ``timeout`` is what the ranks take on an idle machine, with room; they are given
    ``LOADED_RUNNER`` times that, so only a hang fails, not a busy machine."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, port, out, args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout * LOADED_RUNNER
    try:
        while len(results) + len(failures) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = out.get(timeout=min(left, 0.5))
            except queue.Empty:
                if any(not p.is_alive() and p.exitcode != 0 for p in procs):
                    deadline = min(deadline, time.monotonic() + GRACE_S)
                continue
            if ok:
                results[rank] = value
            else:
                failures[rank] = value
                deadline = min(deadline, time.monotonic() + GRACE_S)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(5)
    for r, p in enumerate(procs):
        if r not in results and r not in failures:
            failures[r] = f"no result (exit code {p.exitcode}; killed after the deadline?)"
    if failures:
        raise AssertionError(
            "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        )
    return [results[r] for r in range(world)]
