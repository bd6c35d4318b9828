"""The W8A8 linear kernel (``w8a8.cpp``): ``w8a8_linear(x, w, w_scale, x_scale=None)`` computes
``(int8(x) @ w.T) * x_scale * w_scale`` in one call, quantizing ``x`` per token itself unless a
shared ``x_scale`` [M, 1] is given (a row-parallel linear under TP). Bitwise the result of the
pure-torch path in ``layers/quant/methods.py`` (per-token quantization, ``torch._int_mm``, the
two scales), which stays the fallback where the kernel cannot be built and the test oracle.

Contract: ``x`` [M, K] float32 or bfloat16 (rows contiguous), ``w`` [N, K] int8 (rows
contiguous, as stored: no repacked copy), ``w_scale`` [N] float32; returns [M, N] in x's dtype.
"""

from __future__ import annotations

import torch

from dsv4_serving.kernels.build import CpuKernel


class W8A8Kernel(CpuKernel):
    name = "w8a8"
    dtypes = (torch.float32, torch.bfloat16)
