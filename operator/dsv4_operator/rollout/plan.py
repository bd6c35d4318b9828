"""Which instances of one role a sync renders at the new revision, which it leaves as they are,
and (by omission) which it deletes: a rolling update with ``maxSurge`` / ``maxUnavailable``,
pure, rebuilt every sync from the instances' revision labels and readiness.

New instances first: surge instances of the new revision start above the instance count; an old
instance is replaced (its StatefulSet's template changes, its pod drains on SIGTERM and restarts
at the new revision) only while the ready instances of the role stay at least the count minus
``maxUnavailable``, and not before the new revision has a ready instance of every role (the
gateway pairs prefill and decode of one revision only: until then the old revision must keep
serving whole); old decode instances also wait until every prefill instance is a ready one of
the new revision (``hold_old``, reconcile/desired.py: a request prefilled on an old instance is
decoded on an old one). Surge instances are removed once every instance runs the new revision and is
ready. An instance the autoscaler is draining is left alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One live instance (StatefulSet) of a role."""

    index: int
    revision: str
    """Its ``serving.dsv4.io/revision`` label ("" for one made before revisions)."""
    ready: bool
    surge: bool = False
    """Started by a rollout above the instance count (``serving.dsv4.io/surge``)."""


@dataclass(frozen=True)
class RolePlan:
    update: tuple[int, ...]
    """Instances rendered at the new revision (created, replaced or already there)."""
    keep: tuple[int, ...]
    """Instances left exactly as they are (old revision not replaced yet, or draining)."""
    surge: tuple[int, ...] = ()
    """Of ``update``, the surge instances (above the count, gone when the rollout is)."""

    @property
    def rendered(self) -> tuple[int, ...]:
        return tuple(sorted({*self.update, *self.keep}))


@dataclass(frozen=True)
class Progress:
    """A role's rollout progress, for the status."""

    updated: int
    """Instances at the new revision (surge included)."""
    updated_ready: int
    old: int
    """Instances at another revision."""


def _live_surge(
    live: Mapping[int, Slot], target: int, revision: str, pinned: frozenset[int]
) -> list[int]:
    return sorted(
        i
        for i, s in live.items()
        if i >= target and i not in pinned and s.surge and s.revision == revision
    )


def _surge(
    live: Mapping[int, Slot], target: int, revision: str, max_surge: int, pinned: frozenset[int]
) -> list[int]:
    """The surge instances: live ones of the new revision above the count first, then the
    lowest free indices, ``max_surge`` in all."""
    out = _live_surge(live, target, revision, pinned)[:max_surge]
    i = target
    while len(out) < max_surge:
        if i not in live and i not in pinned:
            out.append(i)
        i += 1
    return sorted(out)


def plan_role(
    slots: Iterable[Slot],
    target: int,
    revision: str,
    max_surge: int,
    max_unavailable: int,
    hold_old: bool = False,
    pinned: frozenset[int] = frozenset(),
) -> RolePlan:
    """``target``: instances wanted (indices ``0..target-1``); ``hold_old``: the new revision
    lacks a ready instance of some role, so no ready old instance may go yet; ``pinned``:
    instances being drained by the autoscaler (kept, never replaced, not counted ready)."""
    live = {s.index: s for s in slots}
    kept_pinned = tuple(sorted(i for i in pinned if i in live))
    base = [i for i in range(target) if i not in pinned]
    old = [i for i in base if i in live and live[i].revision != revision]
    if not old:
        # the last old instances may still be restarting at the new revision: the surge
        # instances serve until every instance is ready (a plain scale-down has none)
        done = all(i in live and live[i].ready for i in base)
        surge = [] if done else _live_surge(live, target, revision, pinned)
        return RolePlan(update=tuple(base + surge), keep=kept_pinned, surge=tuple(surge))
    surge = _surge(live, target, revision, max_surge, pinned)
    available = sum(1 for i in base + surge if i in live and live[i].ready)
    budget = 0 if hold_old else available - (len(base) - max_unavailable)
    unready_old = [i for i in old if not live[i].ready]
    ready_old = [i for i in old if live[i].ready]
    # an old instance that is not ready serves nothing: replacing it costs no capacity
    replaced = set(unready_old + ready_old[: max(0, budget)])
    update = sorted(i for i in base + surge if i not in old or i in replaced)
    keep = sorted({*(i for i in old if i not in replaced), *kept_pinned})
    return RolePlan(update=tuple(update), keep=tuple(keep), surge=tuple(surge))


def new_revision_serves(slots: Iterable[Slot], revision: str) -> bool:
    """Whether a role has a ready instance of ``revision``."""
    return any(s.revision == revision and s.ready for s in slots)


def progress(slots: Iterable[Slot], revision: str) -> Progress:
    slots = list(slots)
    new = [s for s in slots if s.revision == revision]
    return Progress(
        updated=len(new),
        updated_ready=sum(1 for s in new if s.ready),
        old=len(slots) - len(new),
    )
