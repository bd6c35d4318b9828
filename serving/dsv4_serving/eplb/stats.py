"""What EPLB reports to the front end (``/metrics``): plain Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EplbStats:
    """The same on every EP rank (they share one plan)."""

    rearrangements: int = 0
    """Re-placements finished (each moved at least one MoE layer)."""
    layers_moved: int = 0
    """MoE layers whose experts moved, over all re-placements."""
    layers: tuple[str, ...] = ()
    """The balanced MoE layers, as the model names them (``layers.3``, ``mtp.0``)."""
    imbalance_before: tuple[float, ...] = ()
    """Per MoE layer, at the last re-placement: max / mean tokens per EP rank over the window,
    as the placement then in use carried them (1.0 = even)."""
    imbalance_after: tuple[float, ...] = ()
    """The same window's load under the new placement (replicas sharing their expert's load
    evenly, as the routing spreads it)."""
    step: int = 0
    """Forward steps counted so far (dummy ones included)."""
