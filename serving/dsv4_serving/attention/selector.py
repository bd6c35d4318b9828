"""The attention backend object the layers call: built from the platform's one decision
(``platform/backend.py:select_attention_backend``) as its first implementation that can run
here (what a backend owns: ``attention/backends/base.py``).

Implementations are imported only when tried (``torch_npu``, ``flash_mla`` and ``flashinfer``
never load on a machine that does not use them). When none can run, the error names each one
and why (a missing library, a kernel that does not build), instead of a silent fallback.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import torch

from dsv4_serving.attention.backends.base import AttentionBackend
from dsv4_serving.platform.backend import select_attention_backend
from dsv4_serving.platform.device import PlatformError

# implementation name -> "module:Class"
IMPLEMENTATIONS: dict[str, str] = {
    "cpu-mla-paged": "dsv4_serving.attention.backends.mla_torch:MLAPagedKernel",
    "cpu-mla-torch": "dsv4_serving.attention.backends.mla_torch:MLATorch",
    "cuda-flashmla": "dsv4_serving.attention.backends.mla_cuda:MLAFlashMLA",
    "cuda-flashinfer": "dsv4_serving.attention.backends.mla_cuda:MLAFlashInfer",
    "npu-mla-fia": "dsv4_serving.attention.backends.mla_npu:MLAAscend",
    "v4-torch": "dsv4_serving.attention.backends.v4_torch:V4Torch",
}


B = TypeVar("B", bound=AttentionBackend[Any])


class BackendUnavailable(PlatformError):
    """No implementation of the chosen attention backend can run here; the message says why."""


def _load(impl: str) -> type[AttentionBackend[Any]]:
    path = IMPLEMENTATIONS.get(impl)
    if path is None:
        raise BackendUnavailable(f"unknown attention implementation {impl!r}")
    module, cls = path.split(":")
    found: type[AttentionBackend[Any]] = getattr(importlib.import_module(module), cls)
    return found


def attention_backend(config: Mapping[str, Any] | Any, platform: str) -> AttentionBackend[Any]:
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


class DeviceBackend(Generic[B]):
    """A model's attention backend for its weights' device: chosen on first use, again only when
    the device type changes (it owns the cache layout and plans every step)."""

    def __init__(self, config: Any, family: type[B]) -> None:
        self.config, self.family = config, family
        self._backend: B | None = None
        self._device = ""

    def get(self, device: torch.device) -> B:
        if self._backend is None or self._device != device.type:
            backend = attention_backend(self.config, device.type)
            assert isinstance(backend, self.family), (
                f"{backend.name} is not a {self.family.__name__} backend"
            )
            self._backend, self._device = backend, device.type
        return self._backend
