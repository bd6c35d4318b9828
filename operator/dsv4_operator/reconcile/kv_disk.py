"""The KV sidecar's disk tier in an engine pod (``spec.kvCache.diskBytes``): the sidecar's
``--kv-disk-bytes`` / ``--kv-disk-dir`` flags and the volume its files live on.

The volume is an ``emptyDir`` on the node's disk, not a ``hostPath``: the sidecar empties the
tier at start anyway (a restarted engine announces nothing it held before, so old files could
never be pulled), so nothing is gained by outliving the pod, while an emptyDir needs no path
on the node, no permissions set up for the sidecar's non-root user, is cleaned up with the
pod, and is counted as the pod's ephemeral storage. Its ``sizeLimit`` is the tier's cap plus
the host tier's bytes (the file of an entry being read back is deleted just after the read:
at most one at a time, and no entry is larger than the host tier it came from) plus 64Mi for
the file system's own use, so the kubelet never evicts the pod for the tier's own files.
"""

from __future__ import annotations

from typing import Any

from dsv4_operator.api.spec import DeploymentSpec
from dsv4_operator.reconcile.shm import quantity_bytes

KV_DISK_DIR = "/var/cache/dsv4-kv"
VOLUME = "kv-disk"
SLACK = 64 << 20


def disk_tier_bytes(spec: DeploymentSpec) -> int:
    return quantity_bytes(spec.kv_cache.disk_bytes)


def disk_tier_flags(spec: DeploymentSpec) -> list[str]:
    n = disk_tier_bytes(spec)
    return ["--kv-disk-bytes", str(n), "--kv-disk-dir", KV_DISK_DIR] if n else []


def disk_tier_volume(spec: DeploymentSpec, host_bytes: int) -> list[dict[str, Any]]:
    """The pod's volume for the tier ([] when it is off)."""
    n = disk_tier_bytes(spec)
    if not n:
        return []
    return [{"name": VOLUME, "emptyDir": {"sizeLimit": str(n + host_bytes + SLACK)}}]


def disk_tier_mounts(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The sidecar's mount of it ([] when it is off)."""
    return [{"name": VOLUME, "mountPath": KV_DISK_DIR}] if disk_tier_bytes(spec) else []
