"""The per-role ``rollout`` section: how a new revision (model, image, engine flags) replaces
the old one, instance by instance (``dsv4_operator.rollout``)."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_operator.api.fields import crd_object, prop
from dsv4_operator.api.schema import integer


@crd_object(
    rules=[
        (
            "self.maxSurge > 0 || self.maxUnavailable > 0",
            "rollout: maxSurge and maxUnavailable cannot both be 0 (no instance could be "
            "replaced); the default is maxSurge 1, maxUnavailable 0",
        ),
    ],
    defaulted=True,
    description="How a new revision replaces this role's instances: new ones first (maxSurge), "
    "old ones drained and replaced as new ones turn Ready.",
)
@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    max_surge: int = prop(
        integer(
            "Extra instances of the new revision started above the instance count during a "
            "rollout (removed once every instance runs the new revision).",
            default=1,
            minimum=0,
            maximum=64,
        )
    )
    max_unavailable: int = prop(
        integer(
            "Instances that may be below Ready at once during a rollout (0: the ready count "
            "never drops under the instance count).",
            default=0,
            minimum=0,
            maximum=64,
        )
    )
