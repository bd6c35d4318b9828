"""Model implementations and the registry that selects them by architecture name."""

from dsv4_serving.models.registry import REGISTRY, ModelRegistry, UnknownArchitectureError

__all__ = ["REGISTRY", "ModelRegistry", "UnknownArchitectureError"]
