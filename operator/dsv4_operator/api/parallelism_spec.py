"""The deployment's per-role ``parallelism`` section: how an instance's ranks split the model
(tp x cp x dp ranks, ep over them), and the CEL rules context parallel adds to a role."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_operator.api.fields import crd_object, prop
from dsv4_operator.api.schema import integer


@crd_object(
    rules=[
        (
            "!has(self.ep) || self.ep == 1 || self.ep == self.tp * self.dp",
            "parallelism.ep must be 1 (every rank holds every expert) or tp * dp "
            "(experts spread over every rank; the default)",
        ),
        (
            "!has(self.cp) || self.cp == 1 || !has(self.ep) || self.ep == 1",
            "parallelism.cp > 1 needs ep 1: expert parallel with context parallel is not "
            "supported yet",
        ),
    ],
    defaulted=True,
)
@dataclass(frozen=True, kw_only=True)
class Parallelism:
    tp: int = prop(
        integer(
            "Tensor-parallel size (attention heads split across ranks).",
            default=8,
            minimum=1,
            maximum=256,
        )
    )
    dp: int = prop(
        integer(
            "Data-parallel ranks per instance (DPLB balances across them).",
            default=1,
            minimum=1,
            maximum=256,
        )
    )
    ep: int = prop(
        integer(
            "Expert-parallel size: 1 or tp*dp (the default; 1 when cp > 1).",
            minimum=1,
            maximum=1024,
        )
    )
    cp: int = prop(
        integer(
            "Context-parallel size, prefill only: each prompt chunk's tokens split over cp "
            "ranks (ranks = tp * cp * dp); needs ep 1.",
            default=1,
            minimum=1,
            maximum=64,
        )
    )

    def __post_init__(self) -> None:
        if not self.ep:  # unset: experts spread over every rank (no EP under CP yet)
            object.__setattr__(self, "ep", 1 if self.cp > 1 else self.tp * self.dp)

    @property
    def ranks(self) -> int:
        """Rank processes of one instance: tp x cp x dp."""
        return self.tp * self.cp * self.dp


# an instance's ranks in CEL (cp defaults to 1)
RANKS_CEL = (
    "self.parallelism.tp * (has(self.parallelism.cp) ? self.parallelism.cp : 1) "
    "* self.parallelism.dp"
)
_CP1 = "!has(self.parallelism.cp) || self.parallelism.cp == 1"


def cp_rules(role: str) -> list[tuple[str, str]]:
    """Context parallel splits prompts: a prefill role's (with MTP and DP, as the engine)."""
    if role != "prefill":
        return [(_CP1, f"{role}.parallelism.cp must be 1: context parallel is for prefill")]
    return []
