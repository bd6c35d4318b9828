"""The W8A8 linear kernel (``w8a8.cpp``): ``w8a8_linear(x, w, w_scale, x_scale=None)`` computes
``(int8(x) @ w.T) * x_scale * w_scale`` in one call, quantizing ``x`` per token itself unless a
shared ``x_scale`` [M, 1] is given (a row-parallel linear under TP). Bitwise the result of the
pure-torch path in ``layers/quant/methods.py`` (per-token quantization, ``torch._int_mm``, the
two scales), which stays the fallback where the kernel cannot be built and the test oracle.

Contract: ``x`` [M, K] float32 or bfloat16 (rows contiguous), ``w`` [N, K] int8 (rows
contiguous, as stored: no repacked copy), ``w_scale`` [N] float32; returns [M, N] in x's dtype.
"""

from __future__ import annotations

from types import ModuleType

import torch

from dsv4_serving.kernels.build import available, build

DTYPES = (torch.float32, torch.bfloat16)


class W8A8Kernel:
    """The kernel for a quant method, resolved on first use (the build is cached per process).
    ``use_kernel``: None uses it on CPU when it builds, True requires it, False never."""

    def __init__(self, use_kernel: bool | None = None, variant: str = "") -> None:
        """``variant``: another build of the source (``build.VARIANTS``; benchmarks)."""
        self.use_kernel = use_kernel
        self.variant = variant
        self._ext: ModuleType | None = None
        self._resolved = use_kernel is False

    def get(self, x: torch.Tensor) -> ModuleType | None:
        """The extension if it applies to ``x`` (CPU, float32/bfloat16), else None."""
        if not self._resolved:
            self._resolved = True
            if self.use_kernel or available("w8a8", self.variant):
                self._ext = build("w8a8", self.variant)  # KernelUnavailable says why if required
        if self._ext is not None and x.device.type == "cpu" and x.dtype in DTYPES:
            return self._ext
        return None
