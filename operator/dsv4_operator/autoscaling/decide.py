"""``decide``: one autoscaler tick, as a pure function.

Per role it computes a recommendation (capacity terms raise it, SLO and queue breaches add one
instance), then moves cautiously: up after ``breach_ticks`` short ticks (at once in a panic),
never while instances are still starting; down one instance per tick, only to the highest
recommendation of the stabilisation window, never within it of a scale-up or of the start,
never while the other role scales up, and only when the instances left would still meet the SLO.
Stale or missing observations hold every role where it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from dsv4_operator.autoscaling.estimators import (
    add_sample,
    batch_target,
    ceil_div,
    learn_prefill_capacity,
)
from dsv4_operator.autoscaling.policy import ROLES, Policy, Role, RoleBounds
from dsv4_operator.autoscaling.schedule import floors
from dsv4_operator.autoscaling.signals import Observations, RoleSignals

Direction = Literal["up", "down", "hold"]
Blame = Literal["prefill", "decode", "transfer"]


@dataclass(frozen=True)
class RoleState:
    history: tuple[tuple[float, int], ...] = ()
    """(time, recommendation) over the stabilisation window."""
    short_ticks: int = 0
    """Consecutive ticks that recommended more than the current count."""
    last_up: float | None = None
    capacity: float | None = None
    """Learned prefill tokens/s per instance."""
    samples: tuple[tuple[float, float], ...] = ()
    """Decode (running per instance, ITL) samples."""
    running: tuple[tuple[float, float], ...] = ()
    """Decode (time, running per instance) over the metrics window: a sample's ITL p90 covers
    the window, whose busiest moments set it, so it is paired with the window's highest count
    (with the count of the moment, the ticks after a load drop read as few sequences at the
    peak's ITL and the fit collapsed)."""


@dataclass(frozen=True)
class State:
    started_at: float
    """When this autoscaler (or operator) started: no scale-down for one window after it."""
    roles: dict[Role, RoleState] = field(
        default_factory=lambda: {"prefill": RoleState(), "decode": RoleState()}
    )
    last_breach: float | None = None
    """Last tick with TTFT or TPOT above its objective: no role scales down for a window."""


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Condition:
    status: Literal["True", "False"]
    reason: str
    message: str


@dataclass(frozen=True)
class RoleDecision:
    current: int
    """Ready plus starting instances."""
    recommended: int
    target: int
    direction: Direction
    reason: str
    signals: dict[str, float]


@dataclass(frozen=True)
class Decision:
    roles: dict[Role, RoleDecision]
    events: tuple[Event, ...]
    active: Condition
    limited: Condition
    summary: str


def decide(
    obs: Observations | None, state: State, policy: Policy, now: float
) -> tuple[Decision, State]:
    policy, floor_why = with_floors(policy, now)
    if obs is None or now - obs.observed_at > policy.max_age_s:
        return _hold(obs, state, policy, now, floor_why), state
    return _Tick(obs, state, policy, now, floor_why).run()


def with_floors(policy: Policy, now: float) -> tuple[Policy, dict[Role, str]]:
    """``policy`` with each role's min raised by its scheduled windows on at ``now`` (never
    above max), and, per role raised, the window that raised it."""
    on = floors(policy.scheduled, now)
    bounds = dict(policy.bounds)
    why: dict[Role, str] = {}
    for r in ROLES:
        if r in on and on[r][0] > bounds[r].min:
            bounds[r] = RoleBounds(min(on[r][0], bounds[r].max), bounds[r].max)
            why[r] = on[r][1]
    return (replace(policy, bounds=bounds), why) if why else (policy, why)


def _current(s: RoleSignals) -> int:
    return s.ready + s.starting


def _hold(
    obs: Observations | None,
    state: State,
    policy: Policy,
    now: float,
    floor_why: dict[Role, str],
) -> Decision:
    why = "no observations" if obs is None else f"observations are {now - obs.observed_at:.0f}s old"
    roles: dict[Role, RoleDecision] = {}
    for r in ROLES:
        cur = _current(obs.roles[r]) if obs is not None else policy.bounds[r].min
        target = policy.bounds[r].clamp(cur)
        direction: Direction = "hold" if target == cur else ("up" if target > cur else "down")
        reason = floor_why[r] if direction == "up" and r in floor_why else f"holding: {why}"
        roles[r] = RoleDecision(cur, target, target, direction, reason, {})
    msg = f"metrics unavailable ({why}); holding the current size"
    return Decision(
        roles,
        (Event("Warning", "MetricsUnavailable", msg),),
        Condition("False", "MetricsUnavailable", msg),
        Condition("False", "WithinBounds", ""),
        f"hold: {why}",
    )


class _Tick:
    """One tick's working state; ``run`` is the whole decision."""

    def __init__(
        self,
        obs: Observations,
        state: State,
        policy: Policy,
        now: float,
        floor_why: dict[Role, str],
    ) -> None:
        self.obs, self.state, self.policy, self.now = obs, state, policy, now
        self.floor_why = floor_why
        """Roles whose min a scheduled window raised, and which window."""
        self.p, self.d = obs.roles["prefill"], obs.roles["decode"]
        self.enough = obs.requests >= policy.min_requests
        self.events: list[Event] = []
        self.limits: list[tuple[str, str]] = []
        self.bstar = float(policy.running_per_instance)

    def run(self) -> tuple[Decision, State]:
        pol, st = self.policy, self.state
        blame = self._blame()
        pst = st.roles["prefill"]
        capacity = pol.prefill_tokens_per_s or learn_prefill_capacity(
            pst.capacity,
            self.p.prompt_tokens_per_s,
            self.p.waiting,
            self.p.ready,
            breach=blame == "prefill",
        )
        dst = st.roles["decode"]
        itl = self.d.latency_p90 if self.d.latency_p90 is not None else self.obs.tpot_p90
        running = (
            *((t, n) for t, n in dst.running if self.now - t < pol.window_s),
            (self.now, self.d.running / max(self.d.ready, 1)),
        )
        samples = add_sample(dst.samples, max(n for _, n in running), itl)
        bstar = batch_target(
            samples, pol.tpot_s, pol.headroom, pol.running_per_instance, pol.max_num_seqs
        )

        self.bstar = bstar
        p_rec, p_why, p_panic = self._prefill_rec(blame, capacity)
        d_rec, d_why, d_panic = self._decode_rec(blame, bstar)

        p_dec, p_state = self._move("prefill", p_rec, p_why, p_panic, capacity=capacity)
        # Little's law: a saturated prefill scaled up sends decode proportionally more work.
        if p_dec.direction == "up" and self.p.waiting > 0 and self.p.ready > 0:
            floor = ceil_div(self._decode_need(bstar) * p_dec.target / self.p.ready, 1.0)
            if floor > _current(self.d) and floor >= d_rec:
                d_rec, d_why = floor, f"follows prefill {p_dec.current}->{p_dec.target}"
                d_panic = True  # in the same tick, not after breach_ticks
        d_dec, d_state = self._move(
            "decode",
            d_rec,
            d_why,
            d_panic,
            samples=samples,
            running=running,
            other_up=p_dec.direction == "up",
        )
        if d_dec.direction == "up" and p_dec.direction == "down":
            p_dec = replace(
                p_dec,
                target=p_dec.current,
                direction="hold",
                reason="not scaling down: decode scales up this tick",
            )
        p_dec, d_dec = self._ratio(p_dec, d_dec)
        p_dec, d_dec = self._budget(p_dec, d_dec)

        p_dec = replace(p_dec, signals=self._prefill_signals(capacity))
        d_dec = replace(d_dec, signals=self._decode_signals(bstar))
        for dec, role in ((p_dec, "prefill"), (d_dec, "decode")):
            if dec.direction == "up":
                self.events.append(
                    Event("Normal", "ScaledUp", f"{role} {dec.current}->{dec.target}: {dec.reason}")
                )
        new_state = State(
            st.started_at, {"prefill": p_state, "decode": d_state}, self._last_breach()
        )
        return self._decision(p_dec, d_dec), new_state

    # -- signals -----------------------------------------------------------------------------

    def _blame(self) -> Blame | None:
        """Which role (or the KV transfer) a TTFT breach comes from, so the right one scales."""
        o, pol = self.obs, self.policy
        if not (self.enough and o.ttft_p90 is not None and o.ttft_p90 > pol.ttft_s):
            return None
        if self.p.waiting > 0 or (
            self.p.latency_p90 is not None and self.p.latency_p90 > 0.6 * pol.ttft_s
        ):
            return "prefill"
        if self.d.waiting > 0:
            return "decode"
        if o.transfer_p90 is not None and o.transfer_p90 > 0.3 * pol.ttft_s:
            self.events.append(
                Event(
                    "Warning",
                    "KVTransferSlow",
                    f"ttft p90 {o.ttft_p90:.3g}s > {pol.ttft_s:g}s while KV transfer p90 is "
                    f"{o.transfer_p90:.3g}s: adding instances does not fix the transfer",
                )
            )
            return "transfer"
        return "prefill"

    def _prefill_rec(self, blame: Blame | None, capacity: float | None) -> tuple[int, str, bool]:
        pol, p, o = self.policy, self.p, self.obs
        rec, why, panic = 0, "", False
        if capacity:
            # the recent rate only raises the recommendation: a step up acts within a few
            # ticks, a step down still waits for the window (and the stabilisation)
            rate, over = p.prompt_tokens_per_s, ""
            recent = p.prompt_tokens_per_s_recent
            if recent is not None and recent > rate:
                rate, over = recent, " recently"
            rec = ceil_div(rate, pol.utilization * capacity)
            why = f"{rate:.0f} prompt tok/s{over} over {capacity:.0f}/instance"
        delay = self._backlog_delay(capacity, p.ready)
        limit = pol.backlog_ttft_fraction * pol.ttft_s
        if delay is not None and delay > limit:
            rec, why = (
                max(rec, p.ready + 1),
                f"prefill backlog {p.backlog_tokens:.0f} tokens, {delay:.2f}s at capacity",
            )
            panic = delay >= pol.panic * limit
        queue = p.waiting / max(p.ready, 1)
        if queue > pol.waiting_per_instance:
            rec, why = (
                max(rec, p.ready + 1),
                f"prefill queue {queue:.1f}/instance > {pol.waiting_per_instance:g}",
            )
            panic = panic or queue >= pol.panic * pol.waiting_per_instance
        if blame == "prefill" and o.ttft_p90 is not None:
            rec, why = max(rec, p.ready + 1), f"ttft p90 {o.ttft_p90:.3g}s > {pol.ttft_s:g}s"
            panic = panic or o.ttft_p90 >= pol.panic * pol.ttft_s
        return rec, why, panic

    def _backlog_delay(self, capacity: float | None, instances: int) -> float | None:
        """Seconds the prefill backlog takes ``instances`` at ``capacity`` (None: unknown)."""
        tokens = self.p.backlog_tokens
        if not capacity or tokens is None or instances < 1:
            return None
        return tokens / (instances * capacity)

    def _decode_rec(self, blame: Blame | None, bstar: float) -> tuple[int, str, bool]:
        pol, d, o = self.policy, self.d, self.obs
        by_batch = ceil_div(self._decode_need(bstar), 1.0)
        by_kv = ceil_div(d.kv_usage, pol.kv_target)
        rec = max(by_batch, by_kv)
        why = (
            f"{d.running:.0f} running, batch target {bstar:.1f}"
            if by_batch >= by_kv
            else f"KV usage {d.kv_usage:.2f} over {pol.kv_target:g}/instance"
        )
        panic = False
        queue = d.waiting / max(d.ready, 1)
        if queue > pol.decode_waiting_per_instance or blame == "decode":
            rec, why = max(rec, d.ready + 1), f"decode queue {queue:.1f}/instance"
            panic = queue >= pol.panic * pol.decode_waiting_per_instance
        if self.enough and o.tpot_p90 is not None and o.tpot_p90 > pol.tpot_s:
            rec, why = (
                max(rec, d.ready + 1),
                f"tpot p90 {o.tpot_p90 * 1e3:.0f}ms > {pol.tpot_s * 1e3:.0f}ms",
            )
            panic = panic or o.tpot_p90 >= pol.panic * pol.tpot_s
        return rec, (why if rec else ""), panic

    # -- moving ------------------------------------------------------------------------------

    def _move(
        self,
        role: Role,
        rec: int,
        why: str,
        panic: bool,
        *,
        capacity: float | None = None,
        samples: tuple[tuple[float, float], ...] | None = None,
        running: tuple[tuple[float, float], ...] | None = None,
        other_up: bool = False,
    ) -> tuple[RoleDecision, RoleState]:
        pol, s = self.policy, self.obs.roles[role]
        old = self.state.roles[role]
        bounds = pol.bounds[role]
        cur = _current(s)
        want = bounds.clamp(max(rec, bounds.min))
        if rec < want and role in self.floor_why:
            why = self.floor_why[role]
        if rec > bounds.max:
            self.limits.append(("AtMax", f"{role} wants {rec} instances, max is {bounds.max}"))
            if rec > cur:
                self.events.append(
                    Event(
                        "Warning", "SLOAtRisk", f"{role} at max {bounds.max} and still short: {why}"
                    )
                )
        history = tuple((t, n) for t, n in old.history if self.now - t < pol.stabilization_s)
        history = (*history, (self.now, want))
        new = RoleState(
            history=history,
            short_ticks=old.short_ticks + 1 if want > cur else 0,
            last_up=old.last_up,
            capacity=capacity if capacity is not None else old.capacity,
            samples=samples if samples is not None else old.samples,
            running=running if running is not None else old.running,
        )
        if want >= cur and s.blocked:
            msg = f"{role}: {s.blocked} new instance(s) cannot be scheduled; not adding more"
            self.events.append(Event("Warning", "ScaleUpBlocked", msg))
            self.limits.append(("ScaleUpBlocked", msg))
            return RoleDecision(cur, want, cur, "hold", msg, {}), new
        if want > cur:
            return self._up(role, s, cur, want, why, panic, new)
        if want == cur and cur == bounds.clamp(cur):
            if s.starting and why:
                why = f"{why}; {s.starting} instance(s) starting"
            return RoleDecision(cur, want, cur, "hold", why or "at recommendation", {}), new
        return self._down(role, s, cur, want, other_up, new)

    def _up(
        self,
        role: Role,
        s: RoleSignals,
        cur: int,
        want: int,
        why: str,
        panic: bool,
        new: RoleState,
    ) -> tuple[RoleDecision, RoleState]:
        if s.starting:
            msg = f"{why}; waiting for {s.starting} starting instance(s)"
            return RoleDecision(cur, want, cur, "hold", msg, {}), new
        if (
            new.short_ticks < self.policy.breach_ticks
            and not panic
            and cur >= self.policy.bounds[role].min
        ):
            msg = f"{why}; short for {new.short_ticks} tick(s), acting after {self.policy.breach_ticks}"
            return RoleDecision(cur, want, cur, "hold", msg, {}), new
        step = max(1, math.ceil(0.5 * s.ready))
        target = min(want, cur + step) if cur >= self.policy.bounds[role].min else want
        return (
            RoleDecision(
                cur, want, target, "up", why or f"below min {self.policy.bounds[role].min}", {}
            ),
            replace(new, short_ticks=0, last_up=self.now),
        )

    def _down(
        self, role: Role, s: RoleSignals, cur: int, want: int, other_up: bool, new: RoleState
    ) -> tuple[RoleDecision, RoleState]:
        pol = self.policy
        bounds = pol.bounds[role]
        if cur > bounds.max:
            # A lowered max applies at once (still one instance at a time, through a drain).
            return RoleDecision(cur, want, cur - 1, "down", f"above max {bounds.max}", {}), new
        stable = max(n for _, n in new.history)
        last_up = max(
            (t for t in (self.state.roles[r].last_up for r in ROLES) if t is not None),
            default=None,
        )
        blocker = None
        if stable >= cur:
            blocker = f"highest recommendation in the last {pol.stabilization_s:g}s is {stable}"
        elif self.now - self.state.started_at < pol.stabilization_s:
            blocker = "autoscaler started less than one stabilisation window ago"
        elif (
            breach := self._last_breach()
        ) is not None and self.now - breach < pol.stabilization_s:
            blocker = f"an SLO was breached {self.now - breach:.0f}s ago"
        elif last_up is not None and self.now - last_up < pol.stabilization_s:
            blocker = f"scaled up {self.now - last_up:.0f}s ago"
        elif other_up:
            blocker = "the other role scales up this tick"
        elif s.draining:
            blocker = "a drain is already in progress"
        else:
            blocker = self._consolidation_blocker(role, s)
        if blocker is not None:
            return RoleDecision(cur, want, cur, "hold", f"not scaling down: {blocker}", {}), new
        return RoleDecision(cur, want, cur - 1, "down", f"load fits {cur - 1} instance(s)", {}), new

    def _consolidation_blocker(self, role: Role, s: RoleSignals) -> str | None:
        """Would the instances left after removing one still meet the SLO?"""
        pol, o = self.policy, self.obs
        left = s.ready - 1
        if left < 1:
            return "no instance would be left"
        if role == "prefill":
            if (
                self.enough
                and o.ttft_p90 is not None
                and o.ttft_p90 >= pol.scale_down_margin * pol.ttft_s
            ):
                return (
                    f"ttft p90 {o.ttft_p90:.3g}s is not below {pol.scale_down_margin:g}x the target"
                )
            if s.waiting > 0:
                return "prefill requests are waiting"
            cap = pol.prefill_tokens_per_s or self.state.roles["prefill"].capacity
            delay = self._backlog_delay(cap, left)
            if delay is not None and delay > pol.backlog_ttft_fraction * pol.ttft_s:
                return f"the prefill backlog would take {left} instance(s) {delay:.2f}s"
            if cap and s.prompt_tokens_per_s / (left * cap) > pol.utilization:
                return f"{s.prompt_tokens_per_s:.0f} prompt tok/s would exceed {left} instance(s)"
            return None
        if (
            self.enough
            and o.tpot_p90 is not None
            and o.tpot_p90 >= pol.scale_down_margin * pol.tpot_s
        ):
            return f"tpot p90 {o.tpot_p90 * 1e3:.0f}ms is not below {pol.scale_down_margin:g}x the target"
        if s.waiting > 0:
            return "decode requests are waiting"
        need = self._decode_need(self.bstar)
        if need > left:
            return f"decode load needs {need:.2f} instances at batch target {self.bstar:.1f}"
        if s.kv_usage / left > pol.kv_target:
            return f"KV usage would exceed {pol.kv_target:g} per instance on {left}"
        return None

    def _last_breach(self) -> float | None:
        o, pol = self.obs, self.policy
        ttft = o.ttft_p90 is not None and o.ttft_p90 > pol.ttft_s
        tpot = o.tpot_p90 is not None and o.tpot_p90 > pol.tpot_s
        return self.now if self.enough and (ttft or tpot) else self.state.last_breach

    def _decode_need(self, bstar: float) -> float:
        """Instances the decode load needs at the batch target. With the step time known the
        load is the token rate (running / ITL), which stays when instances are removed, while
        the running count grows as each step slows (Little's law)."""
        d = self.d
        itl = d.latency_p90 if d.latency_p90 is not None else self.obs.tpot_p90
        if itl is not None and itl > 0 and d.running > 0:
            return d.running / itl * self.policy.headroom * self.policy.tpot_s / bstar
        return d.running / bstar

    def _ratio(self, p: RoleDecision, d: RoleDecision) -> tuple[RoleDecision, RoleDecision]:
        """Keep prefill:decode within the ratio bounds by raising the smaller role, never by
        shrinking the larger."""
        bounds = self.policy.ratio
        if bounds is None or p.target <= 0 or d.target <= 0:
            return p, d
        lo, hi = bounds
        if p.target / d.target < lo:
            need = self.policy.bounds["prefill"].clamp(math.ceil(lo * d.target - 1e-9))
            if need > p.target:
                p = replace(
                    p, target=need, direction="up", reason=f"prefill:decode ratio >= {lo:g}"
                )
        elif p.target / d.target > hi:
            need = self.policy.bounds["decode"].clamp(math.ceil(p.target / hi - 1e-9))
            if need > d.target:
                d = replace(
                    d, target=need, direction="up", reason=f"prefill:decode ratio <= {hi:g}"
                )
        return p, d

    def _budget(self, p: RoleDecision, d: RoleDecision) -> tuple[RoleDecision, RoleDecision]:
        """Within ``npu_budget``: what exists (or is kept) stays; the NPUs left go one instance
        at a time to the role with the larger share of its increase still ungranted, so both
        roles' increases shrink in proportion to their deficits."""
        pol = self.policy
        if pol.npu_budget is None:
            return p, d
        cost = pol.npus_per_instance
        dec = {"prefill": p, "decode": d}
        if sum(dec[r].target * cost[r] for r in ROLES) <= pol.npu_budget:
            return p, d
        base = {r: min(dec[r].target, dec[r].current) for r in ROLES}
        deficit = {r: dec[r].target - base[r] for r in ROLES}
        # NPUs are free only once held by nobody: an instance scaled down (this tick or
        # draining since an earlier one) keeps its NPUs until its drain ends and it is deleted
        held = {r: dec[r].current + self.obs.roles[r].draining for r in ROLES}
        free = pol.npu_budget - sum(held[r] * cost[r] for r in ROLES)
        grant = {r: 0 for r in ROLES}
        while True:
            fits = [r for r in ROLES if grant[r] < deficit[r] and cost[r] <= free]
            if not fits:
                break
            r = max(fits, key=lambda r: (deficit[r] - grant[r]) / deficit[r])
            grant[r] += 1
            free -= cost[r]
        out = {}
        for r in ROLES:
            x = dec[r]
            if grant[r] == deficit[r]:
                out[r] = x
                continue
            target = base[r] + grant[r]
            msg = (
                f"npuBudget {pol.npu_budget}: {r} gets {target} of {x.target} instance(s) "
                f"({cost[r]} NPU(s) each)"
            )
            self.limits.append(("BudgetExhausted", msg))
            direction: Direction = "up" if target > x.current else "hold"
            out[r] = replace(x, target=target, direction=direction, reason=f"{x.reason}; {msg}")
        return out["prefill"], out["decode"]

    # -- reporting ---------------------------------------------------------------------------

    def _prefill_signals(self, capacity: float | None) -> dict[str, float]:
        sig = {
            "waitingPerInstance": self.p.waiting / max(self.p.ready, 1),
            "promptTokensPerSecond": self.p.prompt_tokens_per_s,
        }
        if capacity and (delay := self._backlog_delay(capacity, self.p.ready)) is not None:
            sig["backlogSeconds"] = delay
        if self.p.prompt_tokens_per_s_recent is not None:
            sig["promptTokensPerSecondRecent"] = self.p.prompt_tokens_per_s_recent
        if self.obs.ttft_p90 is not None:
            sig["ttftP90"] = self.obs.ttft_p90
        if capacity:
            sig["capacityTokensPerSecond"] = capacity
        return sig

    def _decode_signals(self, bstar: float) -> dict[str, float]:
        sig = {
            "runningPerInstance": self.d.running / max(self.d.ready, 1),
            "batchTarget": bstar,
            "kvUsage": self.d.kv_usage / max(self.d.ready, 1),
        }
        if self.obs.tpot_p90 is not None:
            sig["tpotP90"] = self.obs.tpot_p90
        return sig

    def _decision(self, p: RoleDecision, d: RoleDecision) -> Decision:
        moves = [
            f"{r} {x.current}->{x.target}: {x.reason}"
            for r, x in (("prefill", p), ("decode", d))
            if x.direction != "hold"
        ]
        summary = "; ".join(moves) if moves else "hold"
        active = Condition("True", "Active", "observations fresh")
        if not self.enough:
            active = Condition(
                "True",
                "InsufficientData",
                f"{self.obs.requests} requests in the window (< {self.policy.min_requests}): "
                "latency ignored, load signals only",
            )
        limited = (
            Condition("True", self.limits[0][0], self.limits[0][1])
            if self.limits
            else Condition("False", "WithinBounds", "")
        )
        return Decision({"prefill": p, "decode": d}, tuple(self.events), active, limited, summary)
