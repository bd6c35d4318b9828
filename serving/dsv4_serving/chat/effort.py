"""Reasoning-effort prompts: the text a thinking-mode prompt starts with, per effort tier.

Each V4 checkpoint revision ships its own table in its ``encoding/encoding_dsv4.py``. The
preview prompted ``max`` only; the 0731 refresh moved that text to ``high`` and added a stronger
``max``. ``read_effort_table`` takes a checkpoint's table from that file by AST (never by running
it); the built-in tables stand in when a checkpoint has none.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field

_ABSOLUTE_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
_BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n"
)


@dataclass(frozen=True, slots=True)
class EffortTable:
    """Tier -> prompt prefix; a tier the table lacks gets no prefix."""

    prompts: Mapping[str, str] = field(default_factory=dict)
    default: str | None = None

    def prefix(self, tier: str | None) -> str:
        return self.prompts.get(tier if tier is not None else (self.default or ""), "")


V4_PREVIEW = EffortTable({"max": _ABSOLUTE_MAX}, default=None)
V4_0731 = EffortTable({"low": "", "high": _ABSOLUTE_MAX, "max": _BEYOND_MAX}, default="low")


def read_effort_table(source: str) -> EffortTable | None:
    """The table in a checkpoint's encoder source, or None when it has neither form.

    0731 form: ``REASONING_EFFORT_PROMPTS = {...}`` and ``DEFAULT_REASONING_EFFORT = "low"``.
    Preview form: a lone ``REASONING_EFFORT_MAX = "..."`` (the ``max`` tier).
    """
    constants: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    constants[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    prompts = constants.get("REASONING_EFFORT_PROMPTS")
    if isinstance(prompts, dict) and all(isinstance(v, str) for v in prompts.values()):
        default = constants.get("DEFAULT_REASONING_EFFORT")
        return EffortTable(dict(prompts), default if isinstance(default, str) else None)
    lone = constants.get("REASONING_EFFORT_MAX")
    if isinstance(lone, str):
        return EffortTable({"max": lone}, default=None)
    return None
