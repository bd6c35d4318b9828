"""How a pod stops: the preStop pause, each component's drain (``--shutdown-timeout``) and the
pod's ``terminationGracePeriodSeconds``, sized together so kubelet's SIGKILL never cuts a drain.

On deletion kubelet runs preStop (a sleep: endpoints and the gateway drop the pod meanwhile),
then sends SIGTERM: the engine stops taking requests and finishes in-flight ones, the KV sidecar
keeps serving its exports until pulled or expired, the gateway finishes its relays, each for at
most its drain; then EXIT_MARGIN_S to exit. The role's terminationGracePeriodSeconds is the
whole budget, so its drain is what is left of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4_operator.api.spec import (
    EXIT_MARGIN_S,
    MIN_GRACE_S,
    PRESTOP_S,
    ROLES,
    DeploymentSpec,
    RoleSpec,
)

__all__ = ["PRESTOP_S", "Shutdown", "gateway_shutdown", "role_shutdown"]


@dataclass(frozen=True)
class Shutdown:
    prestop_s: int
    drain_s: int
    """``--shutdown-timeout`` of every component in the pod."""

    def lifecycle(self) -> dict[str, Any]:
        """A container's preStop: endpoints drop the pod before SIGTERM starts the drain."""
        return {"preStop": {"sleep": {"seconds": self.prestop_s}}}

    @property
    def grace_s(self) -> int:
        """terminationGracePeriodSeconds: preStop + the longest drain + the exit margin."""
        return self.prestop_s + self.drain_s + EXIT_MARGIN_S


def role_shutdown(role: RoleSpec) -> Shutdown:
    """An engine pod: the engine and its KV sidecar drain alike (exports made late in the
    engine's drain are pulled by decode within it)."""
    return Shutdown(PRESTOP_S, max(0, role.termination_grace_s - MIN_GRACE_S))


def gateway_shutdown(spec: DeploymentSpec) -> Shutdown:
    """The gateway's relays end when the engines' do: its drain is the longest of theirs."""
    return Shutdown(PRESTOP_S, max(role_shutdown(spec.role(r)).drain_s for r in ROLES))
