"""Model registry: architecture name -> lazily imported implementation (the seed's step 3).

Entries are ``"module:Class"`` strings, imported on first use. Third-party packages add or
override entries through the ``dsv4.models`` entry-point group: each entry point names either a
callable taking the registry (``register(registry)``) or a ``"module:Class"`` string-valued
attribute; the entry point's name is the architecture. A later registration of the same
architecture overrides the earlier one and logs a warning naming both classes.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "dsv4.models"

_BUILTIN: dict[str, str] = {
    "DeepseekV4ForCausalLM": "dsv4_serving.models.deepseek_v4:DeepseekV4ForCausalLM",
    "DeepseekV3ForCausalLM": "dsv4_serving.models.deepseek_v3:DeepseekV3ForCausalLM",
}


class UnknownArchitectureError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class Registration:
    architecture: str
    target: str  # "module:Class"
    source: str  # who registered it: "builtin", "entry point <dist>:<name>", or "api"


class ModelRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, Registration] = {}
        self._plugins_loaded = False

    def register(self, architecture: str, target: str, source: str = "api") -> None:
        if ":" not in target:
            raise ValueError(f"model target {target!r} must be 'module:Class'")
        old = self._entries.get(architecture)
        if old is not None and old.target != target:
            log.warning(
                "model architecture %s: %s (from %s) overrides %s (from %s)",
                architecture,
                target,
                source,
                old.target,
                old.source,
            )
        self._entries[architecture] = Registration(architecture, target, source)

    def load_plugins(self) -> None:
        """Apply the ``dsv4.models`` entry points once per process."""
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(getattr(ep, "dist", None), "name", "?")
            source = f"entry point {dist}:{ep.name}"
            obj = ep.load()
            if callable(obj):
                obj(self)
            elif isinstance(obj, str):
                self.register(ep.name, obj, source)
            else:
                raise TypeError(f"{source} is neither a register(registry) callable nor a string")

    def registration(self, architecture: str) -> Registration:
        self.load_plugins()
        try:
            return self._entries[architecture]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise UnknownArchitectureError(
                f"architecture {architecture!r} is not registered; registered: {known}"
            ) from None

    def resolve(self, architecture: str) -> Any:
        """The implementation class, imported now."""
        reg = self.registration(architecture)
        module, _, name = reg.target.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                f"architecture {architecture!r} is registered as {reg.target} "
                f"(by {reg.source}) but that cannot be imported: {exc}"
            ) from exc

    def architectures(self) -> list[str]:
        self.load_plugins()
        return sorted(self._entries)


def _default_registry() -> ModelRegistry:
    reg = ModelRegistry()
    for arch, target in _BUILTIN.items():
        reg.register(arch, target, "builtin")
    return reg


REGISTRY = _default_registry()
