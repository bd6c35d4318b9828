"""Whether this operator replica is the one kopf's peering lets run, read from the peering
object (kopf keeps its pause to itself): the autoscaler acts only there, so a standby replica
never scales or drains (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any


def _alive(peer: Mapping[str, Any], now: datetime) -> bool:
    seen = peer.get("lastseen")
    if not isinstance(seen, str):
        return False
    last = datetime.fromisoformat(seen.replace("Z", "+00:00"))
    return last + timedelta(seconds=int(peer.get("lifetime", 60))) > now


def is_active(peers: Mapping[str, Any] | None, priority: int, now: datetime) -> bool:
    """kopf's rule (kopf/_core/engines/peering.py): a replica pauses while a live peer has a
    higher priority, and every replica pauses while two live ones share a priority. ``peers``:
    the peering object's status (identity -> {priority, lastseen, lifetime}), this replica's own
    entry included when it has written one."""
    live = [p for p in (peers or {}).values() if isinstance(p, Mapping) and _alive(p, now)]
    if any(int(p.get("priority", 0)) > priority for p in live):
        return False
    return sum(int(p.get("priority", 0)) == priority for p in live) <= 1
