"""Prometheus metrics under vLLM's names (dashboards and autoscalers built for vLLM work
unchanged); project-specific ones under ``dsv4_``. One registry per server, not the global one."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dsv4_serving.engine.core.sched.scheduler import SchedulerStats
from dsv4_serving.engine.kv_connector.metadata import KVConnectorStats
from dsv4_serving.eplb.stats import EplbStats

# vLLM's latency buckets
_LATENCY = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0),
)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self._label = {"model_name": model_name}

        def g(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(**self._label)

        def c(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(**self._label)

        def per_rank(name: str, doc: str) -> Any:
            # vLLM's ``engine`` label: the DP rank (the gateway routes by it)
            return Gauge(name, doc, ["model_name", "engine"], registry=r)

        def h(name: str, doc: str) -> Any:
            return Histogram(name, doc, labels, buckets=_LATENCY, registry=r).labels(**self._label)

        self.running = per_rank("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = per_rank("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = per_rank(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_queries = c("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_hits = c("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.preemptions = c("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("vllm:generation_tokens", "Number of generation tokens.")
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token in seconds.")
        self.itl = h("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.")
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.")
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.spec_drafts = c("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = c("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = c(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted draft tokens."
        )
        self.spec_rate = g(
            "dsv4_spec_decode_acceptance_rate", "Accepted / proposed draft tokens so far."
        )
        self.free_blocks = per_rank("dsv4_kv_cache_free_blocks", "Free paged KV blocks.")
        self.total_blocks = per_rank("dsv4_kv_cache_total_blocks", "Paged KV blocks in the pool.")
        self.aborts = c("dsv4_requests_aborted", "Requests aborted (client gone or stop string).")
        self.late_prompts = c(
            "dsv4_late_prompts",
            "Prompts the SLO-aware prompt order set aside: unable to make --prompt-deadline.",
        )
        # PD: this engine's side of KV transfers (its sidecar has the wire-level ones)
        kv_labels = ["model_name", "reason"]
        self.kv_pull_failures = Counter(
            "dsv4_kv_pull_failures",
            "Decode requests whose KV pull failed, by reason.",
            kv_labels,
            registry=r,
        )
        self.kv_recomputes = c(
            "dsv4_kv_recomputes", "Decode requests prefilled locally after a failed KV pull."
        )
        self.kv_prefix_tokens = Counter(
            "dsv4_kv_prefix_tokens",
            "Prompt tokens of prefix pulls: loaded from a host tier (pulled) or computed here "
            "after all (recomputed: the pull failed or was refused).",
            ["model_name", "outcome"],
            registry=r,
        )
        self.kv_prefix_offers = c(
            "dsv4_kv_prefix_offers", "Finished requests' prefixes offered to the host tier."
        )
        self.kv_transfers = Counter(
            "dsv4_kv_engine_transfers",
            "KV exports (prefill) and pulls (decode) that finished.",
            ["model_name", "direction", "outcome"],
            registry=r,
        )
        self.kv_bytes = Counter(
            "dsv4_kv_engine_bytes",
            "KV bytes copied between the cache and the staging region.",
            ["model_name", "direction"],
            registry=r,
        )
        self.kv_seconds = Histogram(
            "dsv4_kv_engine_transfer_seconds",
            "Engine-side KV transfer latency: export = reserve + copy + commit on the prefill "
            "engine; pull = decode request parked until its KV is in its blocks.",
            ["model_name", "direction"],
            buckets=_LATENCY,
            registry=r,
        )
        self.kv_waiting = g(
            "dsv4_kv_requests_waiting_for_remote_kv", "Decode requests waiting for their KV."
        )
        self.kv_errors = Counter(
            "dsv4_kv_request_errors",
            "Requests failed for their KV (HTTP 5xx), by reason.",
            kv_labels,
            registry=r,
        )
        # EPLB (the same on every EP rank, so counted once, not per DP rank)
        self.eplb_imbalance = Gauge(
            "dsv4_eplb_imbalance",
            "EPLB: max / mean tokens per EP rank of a MoE layer over the load window, as the "
            "placement before the last re-placement carried them (when=before) and as the "
            "new one carries the same load (when=after); 1 is even.",
            ["model_name", "layer", "when"],
            registry=r,
        )
        self.eplb_rearrangements = c("dsv4_eplb_rearrangements", "EPLB re-placements finished.")
        self.eplb_layers_moved = c(
            "dsv4_eplb_layers_moved", "MoE layers whose experts EPLB re-placed."
        )
        self._eplb_last = EplbStats()
        self._last: dict[int, SchedulerStats] = {}  # by DP rank

    # ---- the engine's events (``engine.observer.EngineObserver``) -----------------------

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, num_tokens: int, count: int = 1) -> None:
        n = max(1, num_tokens)  # a speculative step yields several tokens at once
        observe_times(self.itl, seconds / n, n * count)

    def finished(
        self, seconds: float, reason: str, prompt_tokens: int, generation_tokens: int
    ) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.success.labels(finished_reason=reason, **self._label).inc()

    def aborted(self) -> None:
        self.aborts.inc()

    def kv_error(self, reason: str) -> None:
        self.kv_errors.labels(reason=reason, **self._label).inc()

    def stats(self, s: SchedulerStats, rank: int = 0) -> None:
        """DP rank ``rank``'s stats: its gauges under ``engine="<rank>"``; the counters add
        what the rank's cumulative counts grew by."""
        last = self._last.get(rank) or SchedulerStats()
        lab = {"engine": str(rank), **self._label}
        self.running.labels(**lab).set(s.num_running)
        self.waiting.labels(**lab).set(s.num_waiting)
        self.kv_usage.labels(**lab).set(s.kv_usage)
        self.free_blocks.labels(**lab).set(s.num_free_blocks)
        self.total_blocks.labels(**lab).set(s.num_total_blocks)
        self.prefix_queries.inc(max(0, s.prefix_queries - last.prefix_queries))
        self.prefix_hits.inc(max(0, s.prefix_hits - last.prefix_hits))
        self.preemptions.inc(max(0, s.num_preemptions - last.num_preemptions))
        self.late_prompts.inc(max(0, s.num_late_prompts - last.num_late_prompts))
        self.spec_drafts.inc(max(0, s.spec_drafts - last.spec_drafts))
        self.spec_draft_tokens.inc(max(0, s.spec_draft_tokens - last.spec_draft_tokens))
        self.spec_accepted.inc(max(0, s.spec_accepted_tokens - last.spec_accepted_tokens))
        self._last[rank] = s
        drafted = sum(x.spec_draft_tokens for x in self._last.values())
        if drafted:
            accepted = sum(x.spec_accepted_tokens for x in self._last.values())
            self.spec_rate.set(accepted / drafted)
        if s.kv_transfer is not None:
            self._kv(s.kv_transfer, last.kv_transfer)
        if s.eplb is not None:
            self._eplb(s.eplb)

    def _eplb(self, e: EplbStats) -> None:
        last = self._eplb_last
        if e.rearrangements <= last.rearrangements:
            return  # nothing new (or another DP rank's copy of the same)
        self.eplb_rearrangements.inc(e.rearrangements - last.rearrangements)
        self.eplb_layers_moved.inc(max(0, e.layers_moved - last.layers_moved))
        for name, before, after in zip(
            e.layers, e.imbalance_before, e.imbalance_after, strict=True
        ):
            for when, v in (("before", before), ("after", after)):
                self.eplb_imbalance.labels(layer=name, when=when, **self._label).set(v)
        self._eplb_last = e

    def _kv(self, k: KVConnectorStats, last: KVConnectorStats | None) -> None:
        last = last or KVConnectorStats()
        lab = self._label
        self.kv_waiting.set(k.num_waiting_for_remote_kv)
        for reason, n in k.pull_failures.items():
            d = n - last.pull_failures.get(reason, 0)
            if d > 0:
                self.kv_pull_failures.labels(reason=reason, **lab).inc(d)
        self.kv_recomputes.inc(max(0, k.recomputes - last.recomputes))
        self.kv_prefix_offers.inc(max(0, k.prefix_offers - last.prefix_offers))
        for outcome, now, before in (
            ("pulled", k.prefix_pulled_tokens, last.prefix_pulled_tokens),
            ("recomputed", k.prefix_recomputed_tokens, last.prefix_recomputed_tokens),
        ):
            if now > before:
                self.kv_prefix_tokens.labels(outcome=outcome, **lab).inc(now - before)
        for direction, outcome, now, before in (
            ("pull", "ok", k.pulls_ok, last.pulls_ok),
            ("pull", "failed", sum(k.pull_failures.values()), sum(last.pull_failures.values())),
            ("export", "ok", k.exports_ok, last.exports_ok),
            ("export", "failed", k.export_failures, last.export_failures),
        ):
            if now > before:
                self.kv_transfers.labels(direction=direction, outcome=outcome, **lab).inc(
                    now - before
                )
        for direction, now, before in (
            ("pull", k.bytes_pulled, last.bytes_pulled),
            ("export", k.bytes_exported, last.bytes_exported),
        ):
            if now > before:
                self.kv_bytes.labels(direction=direction, **lab).inc(now - before)
        for direction, obs in (("pull", k.pull_seconds), ("export", k.export_seconds)):
            h = self.kv_seconds.labels(direction=direction, **lab)
            for x in obs:
                h.observe(x)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def observe_times(h: Any, value: float, times: int) -> None:
    """``h.observe(value)`` ``times`` times as one update: a step's requests share their gap,
    and 256 observes cost ~0.5 ms a step. prometheus_client has no weighted observe, so this
    updates what ``Histogram.observe`` does (its sum and the first bucket the value fits);
    ``test_engine_metrics`` checks the exposition against repeated observes."""
    if times == 1:
        h.observe(value)
        return
    h._sum.inc(value * times)
    for bucket, bound in zip(h._buckets, h._upper_bounds, strict=True):
        if value <= bound:
            bucket.inc(times)
            break
