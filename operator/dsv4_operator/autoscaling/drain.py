"""Drain of one instance before its workload is deleted, pure.

The instance is marked draining where every gateway replica sees it (no new requests), and its
engine is asked ``POST /drain {"migrate": true}`` on every tick until it answers (the loop; a
failed call is retried on the next tick, and the wait below is the fallback): the streams a
gateway can continue leave with their KV through the sidecar and go on at a peer. It is read
directly each tick: it is idle when its engine has nothing in flight (the answer's count, else
its running and waiting gauges: ``with_answer``) and its sidecar holds no
KV exports (a prefill's for remote decodes, a decode's moved streams: the peers pulled), on two
reads at least ``min_gap_s`` apart (a request routed just before the gateways saw the mark
shows up in between). Then it may be deleted; after ``timeout_s`` it is deleted anyway and the
timeout is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from dsv4_operator.autoscaling.decide import Event
from dsv4_operator.autoscaling.policy import Role

Outcome = Literal["draining", "completed", "timed_out"]


@dataclass(frozen=True)
class IdleRead:
    """One direct read of the victim: its engine's queue and its sidecar's held exports."""

    at: float
    running: float
    waiting: float
    exports: float = 0.0

    @property
    def busy(self) -> float:
        return self.running + self.waiting + self.exports


@dataclass(frozen=True)
class Drain:
    instance: str
    role: Role
    started_at: float
    inflight_at_start: float | None = None
    idle_since: float | None = None
    """Time of the first of the consecutive idle reads."""
    moving: int | None = None
    """Streams the engine's first answer to ``POST /drain`` said were moving; None until one
    answered (till then the drain only waits)."""


@dataclass(frozen=True)
class DrainAnswer:
    """The victim engine's answer to ``POST /drain``: streams asked to move, requests in flight
    there, whether their KV moves (a sidecar) or is recomputed where they go."""

    migrating: int
    in_flight: int
    kv: bool


def parse_answer(doc: object) -> DrainAnswer | None:
    """A ``POST /drain`` answer's body; None when it is not one (an older engine: wait only)."""
    if not isinstance(doc, dict) or doc.get("draining") is not True:
        return None
    migrating, in_flight, kv = doc.get("migrating"), doc.get("in_flight"), doc.get("kv")
    if not (isinstance(migrating, int) and isinstance(in_flight, int) and isinstance(kv, bool)):
        return None
    return DrainAnswer(migrating, in_flight, kv)


def with_answer(read: IdleRead | None, answer: DrainAnswer | None) -> IdleRead | None:
    """The tick's read with the engine's own count of requests in flight (this tick's
    ``POST /drain`` answer) in place of the core's running and waiting gauges: after streams
    moved, the core's gauges can keep the count of the moved ones until its next busy step
    (an idle core publishes no new stats), while the front end counts the requests it still
    answers. Without an answer the gauges stand."""
    if read is None or answer is None:
        return read
    return replace(read, running=float(answer.in_flight), waiting=0.0)


def asked(drain: Drain, answer: DrainAnswer | None) -> tuple[Drain, Event | None]:
    """Record one ``POST /drain`` answer (None: the call failed; the next tick asks again).
    The loop asks on every tick of the drain (a stream still in its prefill at one call moves
    at a later one; each answer counts every movable stream still there, so only the first
    one's count is kept), and the first answer posts ``DrainMigrating``."""
    if answer is None or drain.moving is not None:
        return drain, None
    drain = replace(drain, moving=answer.migrating)
    how = "with their KV" if answer.kv else "without KV (recomputed where they go)"
    msg = (
        f"{drain.role} instance {drain.instance}: {answer.migrating} stream(s) moving {how}, "
        f"{answer.in_flight} in flight"
    )
    return drain, Event("Normal", "DrainMigrating", msg)


def start(instance: str, role: Role, now: float, read: IdleRead | None) -> tuple[Drain, Event]:
    inflight = read.busy if read is not None else None
    what = f"{inflight:.0f} in flight" if inflight is not None else "load unknown"
    return (
        Drain(instance, role, now, inflight),
        Event("Normal", "DrainStarted", f"{role} instance {instance}: no new requests ({what})"),
    )


def step(
    drain: Drain, read: IdleRead | None, now: float, timeout_s: float, min_gap_s: float
) -> tuple[Drain, Outcome, Event | None]:
    """Advance one tick. A failed read (None) is not idle: only the timeout ends such a drain."""
    took = now - drain.started_at
    if read is not None and read.busy == 0:
        since = drain.idle_since if drain.idle_since is not None else read.at
        drain = replace(drain, idle_since=since)
        if read.at - since >= min_gap_s:
            start_load = (
                f", {drain.inflight_at_start:.0f} in flight at start"
                if drain.inflight_at_start is not None
                else ""
            )
            moved = f", {drain.moving} asked to move" if drain.moving else ""
            msg = (
                f"{drain.role} instance {drain.instance} idle after {took:.0f}s{start_load}{moved}"
            )
            return drain, "completed", Event("Normal", "DrainCompleted", msg)
    else:
        drain = replace(drain, idle_since=None)
    if took >= timeout_s:
        left = f"{read.busy:.0f} still in flight" if read is not None else "unreachable"
        msg = (
            f"{drain.role} instance {drain.instance} not idle after {timeout_s:g}s ({left}); "
            "deleting it anyway (its engine's SIGTERM drain is the backstop)"
        )
        return drain, "timed_out", Event("Warning", "DrainTimedOut", msg)
    return drain, "draining", None


def cancel(drain: Drain, why: str) -> Event:
    """A scale-up of the role takes the draining instance back (no cold start)."""
    return Event("Normal", "DrainCancelled", f"{drain.role} instance {drain.instance}: {why}")
