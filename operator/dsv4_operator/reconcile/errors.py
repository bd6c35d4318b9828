"""The one error a sync reports as a problem of the deployment rather than a bug of the operator."""

from __future__ import annotations


class ReconcileError(ValueError):
    """The spec asks for something this cluster cannot provide, or the cluster reports something
    the operator cannot build on (a malformed device-plugin annotation); the message says what,
    ``reason`` is the Degraded condition's reason."""

    def __init__(self, message: str, reason: str = "InvalidSpec") -> None:
        super().__init__(message)
        self.reason = reason
