"""Counters of the engine's KV transfers, shipped to the front end with the scheduler stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KVConnectorStats:
    num_waiting_for_remote_kv: int = 0
    pulls_ok: int = 0
    pull_failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    recomputes: int = 0  # failed pulls prefilled locally (policy recompute)
    exports_ok: int = 0
    export_failures: int = 0
    bytes_pulled: int = 0
    bytes_exported: int = 0
    # observations since the last take() (histograms)
    pull_seconds: list[float] = field(default_factory=list)
    export_seconds: list[float] = field(default_factory=list)

    def take(self) -> KVConnectorStats:
        """A copy for the front end; the observations move with it (each is sent once)."""
        out = KVConnectorStats(
            self.num_waiting_for_remote_kv, self.pulls_ok, dict(self.pull_failures),
            self.recomputes, self.exports_ok, self.export_failures, self.bytes_pulled,
            self.bytes_exported, self.pull_seconds, self.export_seconds,
        )  # fmt: skip
        self.pull_seconds, self.export_seconds = [], []
        return out
