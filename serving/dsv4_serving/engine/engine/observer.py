"""How the front end tells metrics what happened to requests, one typed method per event (the
engine stays free of prometheus; ``entrypoints.metrics.EngineMetrics`` is the implementation)."""

from __future__ import annotations

from typing import Protocol

from dsv4_serving.engine.core.sched.scheduler import SchedulerStats


class EngineObserver(Protocol):
    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        """A request's first output arrived ``seconds`` after it did."""

    def inter_token(self, seconds: float, num_tokens: int, count: int = 1) -> None:
        """``num_tokens`` tokens (more than one with speculative decoding) came ``seconds``
        after the request's previous ones, for ``count`` requests (a step's share a gap)."""

    def finished(
        self, seconds: float, reason: str, prompt_tokens: int, generation_tokens: int
    ) -> None:
        """A request finished (``reason``: stop | length) ``seconds`` after it arrived."""

    def aborted(self) -> None:
        """A request went away before it finished (client gone, or a stop string)."""

    def kv_error(self, reason: str) -> None:
        """A PD request failed for its KV (HTTP 5xx), ``reason`` as the connector names it."""

    def stats(self, stats: SchedulerStats, rank: int = 0) -> None:
        """DP rank ``rank``'s scheduler stats after a step (one call per rank)."""


class NullObserver:
    """Observes nothing (tests, benchmarks)."""

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        pass

    def inter_token(self, seconds: float, num_tokens: int, count: int = 1) -> None:
        pass

    def finished(
        self, seconds: float, reason: str, prompt_tokens: int, generation_tokens: int
    ) -> None:
        pass

    def aborted(self) -> None:
        pass

    def kv_error(self, reason: str) -> None:
        pass

    def stats(self, stats: SchedulerStats, rank: int = 0) -> None:
        pass
