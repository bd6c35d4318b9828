"""A replica that starts after another died does not wait for the dead one's peering entry.

kopf's peering object lists every live replica (identity -> priority, lastseen, lifetime), and
a replica pauses while a live peer has a higher priority or shares its own. A replica killed
without its shutdown (SIGKILL, OOM, a lost node) leaves its entry "live" for kopf's lifetime
(60 s), so its successor, usually of the same priority, pauses that long: no syncs, no
autoscaling. In a pod the chart sets ``POD_ID`` (kopf's identity) to the pod's name, so at
start an entry whose pod is gone can be dropped. Only identities that can be pod names are
considered: kopf's out-of-cluster ids (``user@host/...``) are never touched.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from dsv4_operator.kube import Kube

log = logging.getLogger(__name__)

_POD_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a DNS-1123 subdomain


def replica_priority(given: int | None, pod: str | None) -> int:
    """The peering priority: the one given, else in a pod one derived from its name (stable
    for the pod, different between the chart's replicas: kopf pauses every replica that
    shares a priority, so two replicas of one Deployment would both stand still), else 0."""
    if given is not None:
        return given
    if not pod:
        return 0
    return 1 + (zlib.crc32(pod.encode()) & 0x3FFFFFFF)


def dead_peers(
    status: Mapping[str, Any] | None, own: str, pod_exists: Callable[[str], bool]
) -> list[str]:
    """The entries of a peering object's status written by pods that no longer exist; never
    this replica's own, never an id that cannot be a pod's name."""
    return sorted(
        peer
        for peer in (status or {})
        if peer != own and _POD_NAME.match(peer) and not pod_exists(peer)
    )


def forget_dead_peers(
    kube: Kube, kind: str, namespace: str, name: str, own: str, pod_namespace: str
) -> list[str]:
    """Drop dead pods' entries from one peering object (a merge patch setting them to null);
    the ids dropped. Any API error leaves the object as it was: kopf's expiry still applies."""
    obj = kube.get(kind, namespace, name)
    if obj is None:
        return []
    dead = dead_peers(
        obj.get("status"), own, lambda pod: kube.get("Pod", pod_namespace, pod) is not None
    )
    if dead:
        kube.merge_patch(kind, namespace, name, {"status": dict.fromkeys(dead)})
        log.info("dropped the peering entries of pods that are gone: %s", ", ".join(dead))
    return dead
