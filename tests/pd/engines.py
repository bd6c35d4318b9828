"""Real ``dsv4 engine`` processes for the pd tier (prefill, decode, both): the one process helper
(``dsv4_common.process.Service``), plus the pool size each engine reports once ready."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from dsv4_common.process import Service, dsv4_argv, free_port
from tests.helpers import wait_for

COMMON = [
    *("--load-format", "dummy", "--dtype", "float32", "--seed", "0", "--max-model-len", "512"),
    *("--num-kv-blocks", "900", "--max-num-seqs", "40", "--log-level", "WARNING"),
]


class EngineProc(Service):
    total_blocks = 0

    def wait_ready(self, timeout_s: float = 180.0) -> Self:
        super().wait_ready(timeout_s)
        # the pool's size arrives with the core's first stats message
        wait_for(
            f"engine {self.name}'s first stats",
            lambda: self.metric("dsv4_kv_cache_total_blocks"),
            30,
            0.1,
        )
        self.total_blocks = int(self.metric("dsv4_kv_cache_total_blocks"))
        return self

    def free_blocks(self) -> int:
        return int(self.metric("dsv4_kv_cache_free_blocks"))


def start_engine(name: str, log_dir: Path, *args: str) -> EngineProc:
    """``dsv4 engine`` with the tier's common flags and ``args``, started (not yet ready)."""
    port = free_port()
    argv = dsv4_argv("engine", "--host", "127.0.0.1", "--port", str(port), *COMMON, *args)
    e = EngineProc(name, argv, log_dir / f"engine-{name}.log", f"http://127.0.0.1:{port}")
    e.start(env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    return e
