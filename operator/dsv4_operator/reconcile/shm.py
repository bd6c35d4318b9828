"""An engine pod's in-memory /dev/shm: the KV sidecar's staging region plus the engine's own
shared memory (multiprocessing queues, semaphores, torch's shared tensors). The sidecar reserves
its region's pages at start (``posix_fallocate``), so a region as large as the volume fails the
pod with ENOSPC; the staging size is derived from ``shmSize`` instead."""

from __future__ import annotations

import re
from decimal import Decimal

from dsv4_operator.reconcile.errors import ReconcileError

MiB = 1 << 20
ENGINE_SHM_RESERVE = 256 * MiB
"""Left to the engine container out of the shared volume."""
MIN_STAGING = 64 * MiB
"""The smallest staging region worth running (a few prompts of the tiny models)."""
MIN_SHM = ENGINE_SHM_RESERVE + MIN_STAGING
"""The CRD refuses less (``320Mi``); ``api/crd.py`` states the same figure as a quantity."""

_SUFFIXES: dict[str, int | Decimal] = {
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "m": Decimal("0.001"),
}


_QUANTITY = re.compile(
    r"((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?"
)


def quantity(text: str) -> Decimal:
    """A non-negative Kubernetes quantity (``1Gi``, ``500m``, ``1e9``) as an exact number."""
    m = _QUANTITY.fullmatch(text)
    if m is None:
        raise ReconcileError(f"{text!r} is not a Kubernetes quantity (e.g. 1Gi)")
    number, suffix = m.groups()
    return Decimal(number) * Decimal(_SUFFIXES[suffix] if suffix else 1)


def quantity_bytes(text: str) -> int:
    """A non-negative Kubernetes quantity (``1Gi``, ``512M``, ``1e9``) in bytes, rounded down."""
    return int(quantity(text))


def staging_bytes(role: str, shm_size: str) -> int:
    """The sidecar's staging region for a pod whose /dev/shm is ``shm_size``."""
    total = quantity_bytes(shm_size)
    if total < MIN_SHM:
        raise ReconcileError(
            f"{role}.shmSize {shm_size} cannot hold the KV staging region (at least 64Mi) plus "
            f"the engine's own 256Mi of shared memory: set it to at least 320Mi"
        )
    return total - ENGINE_SHM_RESERVE


def host_tier_bytes(role: str, host_bytes: str, shm_size: str) -> int:
    """The sidecar's ``--kv-host-bytes``: ``kvCache.hostBytes``, which must fit its staging
    region (the sidecar refuses more at start; said here, in the resource's terms)."""
    n = quantity_bytes(host_bytes)
    staging = staging_bytes(role, shm_size)
    if n > staging:
        raise ReconcileError(
            f"kvCache.hostBytes {host_bytes} exceeds the {role} KV sidecar's staging region "
            f"({staging} bytes: {role}.shmSize {shm_size} minus 256Mi for the engine)"
        )
    return n
