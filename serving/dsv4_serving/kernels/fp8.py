"""The fp8 block-scaled linear kernel (``fp8.cpp``): ``fp8_linear(x, w, scale, bn, bk,
index=-1)`` computes ``x @ (e4m3(w) * scale).T`` in one call, dequantizing 4 rows at a time into
a thread-local buffer and running every token over them with FMAs. The dequantized values are
the pure-torch path's (``layers/quant/methods.py``: ``Fp8Block``) exactly; the sums are in
another order (float32 rounding, about 1e-7 relative). That path stays the fallback and the
oracle.

Contract: ``x`` [..., K] float32; ``w`` float8_e4m3fn [N, K] or stacked [E, N, K] with
``index``; ``scale`` float32 [ceil(N / bn), ceil(K / bk)] (stacked alike); returns [..., N].
"""

from __future__ import annotations

from dsv4_serving.kernels.build import CpuKernel


class Fp8Kernel(CpuKernel):
    name = "fp8"
