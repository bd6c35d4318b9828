"""The attention backend object the layers call: built from the one decision
(``select_attention_backend``) as its first implementation that can run here.

A backend owns what differs between attention kernels (vLLM's Backend / MetadataBuilder /
Impl split, kept small):
  - the cache layout and its constraints (block size, dtype): ``allocate_cache`` and
    ``check_cache`` (a kernel that needs block 64 says so when the cache is allocated);
  - the per-step metadata (``plan``): built once per step from the ``AttentionMetadata`` and
    memoized on it, so every layer of the step reads the same tables;
  - the attention itself (family-specific methods, ``platform/mla_*.py``, ``platform/v4_torch.py``).

Implementations are imported only when tried (``torch_npu``, ``flash_mla`` and ``flashinfer``
never load on a machine that does not use them). When none can run, the error names each one
and why (a missing library, a kernel that does not build), instead of a silent fallback.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, ClassVar

from dsv4_serving.platform.backend import AttentionBackendChoice, select_attention_backend
from dsv4_serving.platform.device import PlatformError

# implementation name -> "module:Class"
IMPLEMENTATIONS: dict[str, str] = {
    "cpu-mla-paged": "dsv4_serving.platform.mla_torch:MLAPagedKernel",
    "cpu-mla-torch": "dsv4_serving.platform.mla_torch:MLATorch",
    "cuda-flashmla": "dsv4_serving.platform.mla_cuda:MLAFlashMLA",
    "cuda-flashinfer": "dsv4_serving.platform.mla_cuda:MLAFlashInfer",
    "npu-mla-fia": "dsv4_serving.platform.mla_npu:MLAAscend",
    "v4-torch": "dsv4_serving.platform.v4_torch:V4Torch",
}


class BackendUnavailable(PlatformError):
    """No implementation of the chosen attention backend can run here; the message says why."""


class AttentionBackend:
    """Base of every implementation. ``unavailable()`` is None when it can run here, else the
    reason; it is checked before the constructor runs."""

    name: ClassVar[str] = ""

    def __init__(self, choice: AttentionBackendChoice) -> None:
        self.choice = choice

    @classmethod
    def unavailable(cls) -> str | None:
        return None

    def describe(self) -> str:
        return self.name


def _load(impl: str) -> type[AttentionBackend]:
    path = IMPLEMENTATIONS.get(impl)
    if path is None:
        raise BackendUnavailable(f"unknown attention implementation {impl!r}")
    module, cls = path.split(":")
    found: type[AttentionBackend] = getattr(importlib.import_module(module), cls)
    return found


def attention_backend(config: Mapping[str, Any] | Any, platform: str) -> AttentionBackend:
    """The backend for ``config`` (raw dict or parsed config) on ``platform``: the first of the
    decision's implementations that can run here."""
    choice = select_attention_backend(config, platform)
    if not choice.implementations:
        raise BackendUnavailable(
            f"attention backend {choice.name}: no implementation for this model family on "
            f"{platform} ({choice.reason})"
        )
    reasons = []
    for impl in choice.implementations:
        cls = _load(impl)
        why = cls.unavailable()
        if why is None:
            return cls(choice)
        reasons.append(f"{impl}: {why}")
    raise BackendUnavailable(
        f"attention backend {choice.name}: none of its implementations can run here ("
        + "; ".join(reasons)
        + ")"
    )


def library_missing(module: str, install: str) -> str | None:
    """None when ``module`` imports, else why not and what to install."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # an ImportError, or a library whose native part fails to load
        return f"{module} does not import ({type(exc).__name__}: {exc}); {install}"
    return None
