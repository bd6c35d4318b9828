"""What every attention backend is (vLLM's Backend / MetadataBuilder / Impl split, kept small).

A backend owns what differs between attention kernels:
  - the cache layout and its constraints (block size, dtype): ``cache_class``, ``check_cache``
    and ``allocate_cache`` (a kernel that needs block 64 says so when the cache is allocated);
  - the per-step metadata (``plan``): built once per step from the ``AttentionMetadata`` and
    memoized on it, so every layer of the step reads the same tables;
  - the attention itself (family-specific methods, ``attention/backends/mla_*.py``,
    ``attention/backends/v4_torch.py``).
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch

from dsv4_serving.attention.metadata import AttentionMetadata
from dsv4_serving.platform.backend import AttentionBackendChoice

StepT = TypeVar("StepT")


class AttentionBackend(Generic[StepT]):
    """Base of every implementation. ``unavailable()`` is None when it can run here, else the
    reason; it is checked before the constructor runs."""

    name: ClassVar[str] = ""
    # the KV cache layout this backend reads and writes: a class with ``allocate(config,
    # num_blocks, block_size, num_slots, device, dtype, lookahead)``
    cache_class: ClassVar[type[Any]]

    def __init__(self, choice: AttentionBackendChoice) -> None:
        self.choice = choice

    @classmethod
    def unavailable(cls) -> str | None:
        return None

    def describe(self) -> str:
        return self.name

    # ---- cache layout ----------------------------------------------------------------------
    def check_cache(self, block_size: int, dtype: torch.dtype) -> None:
        """Raise ``ValueError`` naming the constraint when the layout cannot serve this cache."""

    def allocate_cache(
        self,
        config: Any,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        device: torch.device | str,
        dtype: torch.dtype,
        lookahead: int = 0,
    ) -> Any:
        """``lookahead``: the most positions a step may write past what is kept (speculative
        tokens); layouts with per-sequence rings give them that much slack."""
        self.check_cache(block_size, dtype)
        return self.cache_class.allocate(
            config, num_blocks, block_size, num_slots, device, dtype, lookahead
        )

    # ---- per-step metadata -----------------------------------------------------------------
    def plan(self, meta: AttentionMetadata, block_size: int) -> StepT:
        """This step's plan, built by the first layer that asks and shared by the others."""
        key = ("plan", self.name, block_size)
        got = meta.memo.get(key)
        if got is None:
            got = meta.memo[key] = self.build_step(meta, block_size)
        return cast(StepT, got)

    def build_step(self, meta: AttentionMetadata, block_size: int) -> StepT:
        raise NotImplementedError


def library_missing(module: str, install: str) -> str | None:
    """None when ``module`` imports, else why not and what to install."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # an ImportError, or a library whose native part fails to load
        return f"{module} does not import ({type(exc).__name__}: {exc}); {install}"
    return None
