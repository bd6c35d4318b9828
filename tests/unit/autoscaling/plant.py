"""A fluid model of a PD deployment for replaying load traces through ``decide`` (pure).

Prefill: a token queue served at ``capacity`` tokens/s per ready instance; TTFT grows with the
queue. Decode: Little's law with a step time linear in the batch (``itl = a + b * running``).
New instances are Ready ``cold_start_s`` after the decision; a scaled-down one drains for a tick.
The numbers are not any real engine's; the properties checked hold for any monotone plant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from dsv4_operator.autoscaling.decide import Decision, State, decide
from dsv4_operator.autoscaling.policy import Policy, Role
from dsv4_operator.autoscaling.signals import Observations, RoleSignals


@dataclass
class Pool:
    ready: int = 1
    starting: list[float] = field(default_factory=list)
    """Times at which each starting instance becomes Ready."""
    draining: int = 0

    def apply(self, target: int, now: float, cold_start_s: float) -> None:
        self.draining = 0
        cur = self.ready + len(self.starting)
        if target > cur:
            self.starting += [now + cold_start_s] * (target - cur)
        elif target < cur:
            if self.starting:
                self.starting.pop()  # cancel a starting instance first
            else:
                self.ready -= 1
                self.draining = 1

    def advance(self, now: float) -> None:
        became = [t for t in self.starting if t <= now]
        self.ready += len(became)
        self.starting = [t for t in self.starting if t > now]


@dataclass
class Plant:
    capacity: float = 1000.0
    isl: float = 500.0
    osl: float = 100.0
    itl_a: float = 0.01
    itl_b: float = 0.002
    cold_start_s: float = 45.0
    max_batch: float = 64.0
    pools: dict[Role, Pool] = field(default_factory=lambda: {"prefill": Pool(), "decode": Pool()})
    backlog: float = 0.0

    def observe(self, rate: float, now: float, dt: float) -> Observations:
        p, d = self.pools["prefill"], self.pools["decode"]
        arrival = rate * self.isl
        service = p.ready * self.capacity
        self.backlog = max(0.0, self.backlog + (arrival - service) * dt)
        served = service if self.backlog > 0 else arrival
        base = self.isl / self.capacity
        rho = arrival / service if service else math.inf
        ttft = base / max(1e-3, 1.0 - min(rho, 0.999)) + self.backlog / max(service, 1.0)
        n = max(d.ready, 1)
        denom = 1.0 - rate * self.osl * self.itl_b / n
        running = rate * self.osl * self.itl_a / denom if denom > 0 else self.max_batch * n
        running = min(running, self.max_batch * n)
        waiting_d = 0.0 if denom > 0 and running < self.max_batch * n else rate * 2.0
        itl = self.itl_a + self.itl_b * running / n
        return Observations(
            observed_at=now,
            roles={
                "prefill": RoleSignals(
                    ready=p.ready,
                    starting=len(p.starting),
                    draining=p.draining,
                    waiting=self.backlog / self.isl,
                    prompt_tokens_per_s=served,
                ),
                "decode": RoleSignals(
                    ready=d.ready,
                    starting=len(d.starting),
                    draining=d.draining,
                    waiting=waiting_d,
                    running=running,
                    kv_usage=running / (2 * self.max_batch),
                    latency_p90=itl,
                ),
            },
            ttft_p90=ttft,
            tpot_p90=itl,
            requests=int(rate * 60),
        )


@dataclass(frozen=True)
class Tick:
    now: float
    obs: Observations
    decision: Decision


def replay(
    plant: Plant, policy: Policy, rate: Callable[[float], float], duration_s: float
) -> list[Tick]:
    state = State(started_at=-10_000.0)
    ticks: list[Tick] = []
    now = 0.0
    while now < duration_s:
        for pool in plant.pools.values():
            pool.advance(now)
        obs = plant.observe(rate(now), now, policy.interval_s)
        dec, state = decide(obs, state, policy, now)
        ticks.append(Tick(now, obs, dec))
        for role, pool in plant.pools.items():
            pool.apply(dec.roles[role].target, now, plant.cold_start_s)
        now += policy.interval_s
    return ticks
