"""The sidecar's Prometheus metrics (project-specific names under ``dsv4_kv_``), on a registry of
its own: nothing global, two sidecars in one process (tests, benchmarks) do not collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# bytes per second, 10 MB/s .. 100 GB/s
BANDWIDTH_BUCKETS = (1e7, 3e7, 1e8, 3e8, 1e9, 2e9, 4e9, 8e9, 1.6e10, 3.2e10, 6.4e10, 1e11)


class SidecarMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.bytes_moved = Counter(
            "dsv4_kv_transfer_bytes",
            "KV bytes moved between sidecars",
            ["direction", "transport"],
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "dsv4_kv_transfer_latency_seconds",
            "Pull latency, from the decode engine's request to the last byte in staging",
            ["transport"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.bandwidth = Histogram(
            "dsv4_kv_transfer_bandwidth_bytes_per_second",
            "Per-pull bandwidth (bytes / data-phase seconds)",
            ["transport"],
            buckets=BANDWIDTH_BUCKETS,
            registry=r,
        )
        self.pulls = Counter("dsv4_kv_pulls", "Pulls finished, by outcome", ["outcome"], registry=r)
        self.adopted = Counter(
            "dsv4_kv_pulls_adopted",
            "Pulls the engine's client copied itself into a grant (same host; among the done)",
            registry=r,
        )
        self.pull_failures = Counter(
            "dsv4_kv_pull_failures", "Pulls that failed, by reason", ["reason"], registry=r
        )
        self.exports = Counter("dsv4_kv_exports", "Exports registered by the engine", registry=r)
        self.releases = Counter(
            "dsv4_kv_released",
            "Staging extents freed, by kind (export|import) and reason (pulled|expired|aborted)",
            ["kind", "reason"],
            registry=r,
        )
        self.lease_expiries = Counter(
            "dsv4_kv_lease_expiries", "Leases that ran out before release", ["kind"], registry=r
        )
        self.auth_failures = Counter(
            "dsv4_kv_auth_failures", "Peers refused for failing authentication", registry=r
        )
        self.frames_rejected = Counter(
            "dsv4_kv_frames_rejected",
            "Malformed, oversize or unexpected frames refused",
            ["reason"],
            registry=r,
        )
        self.connections = Gauge(
            "dsv4_kv_peer_connections", "Open peer connections (served)", registry=r
        )
        self.staging_total = Gauge(
            "dsv4_kv_staging_bytes", "Size of the staging region's data area", registry=r
        )
        self.staging_free = Gauge(
            "dsv4_kv_staging_free_bytes", "Free bytes in the staging region", registry=r
        )
        self.active_exports = Gauge("dsv4_kv_active_exports", "Exports held", registry=r)
        self.active_imports = Gauge("dsv4_kv_active_imports", "Pulled extents held", registry=r)
        self.host_tier_bytes = Gauge(
            "dsv4_kv_host_tier_bytes", "Bytes of the host tier's cached prefixes", registry=r
        )
        self.host_tier_entries = Gauge(
            "dsv4_kv_host_tier_entries", "Cached prefixes in the host tier", registry=r
        )
        self.disk_tier_bytes = Gauge(
            "dsv4_kv_disk_tier_bytes",
            "Bytes of the disk tier's files (prefixes the host tier spilled)",
            registry=r,
        )
        self.disk_tier_entries = Gauge(
            "dsv4_kv_disk_tier_entries", "Cached prefixes in the disk tier", registry=r
        )
        self.disk_tier_spills = Counter(
            "dsv4_kv_disk_tier_spills",
            "Host-tier entries the LRU evicted that went to the disk tier",
            registry=r,
        )
        self.disk_tier_hits = Counter(
            "dsv4_kv_disk_tier_hits",
            "Disk-tier entries read back (checked) for a pull, into the host tier",
            registry=r,
        )
        self.disk_tier_drops = Counter(
            "dsv4_kv_disk_tier_drops",
            "Entries the disk tier dropped or did not take, by reason (evicted, not_taken, "
            "write_error, read_error, checksum_mismatch, fingerprint_mismatch)",
            ["reason"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
