"""The V4 attention kernel (``v4_attn.cpp``): ``v4_attn(q, ksrc, kidx, csrc, cidx, sink,
scale)``, one call per layer for a step's decode rows and one for its prefill rows, instead of
the torch path's gathers, score and mask tensors, softmax and products. Reads the key rows in
place and skips the keys a query does not see (outside its window, entries it did not select),
so a prefill chunk costs its window, not the whole chunk. The torch path
(``attention/v4.py``) stays the fallback (no compiler, other dtypes) and the oracle.

Contract: float32, contiguous, on the CPU; ``q`` [T, H, D], ``ksrc`` [Rk, D] and ``csrc``
[Rc, D] the key (= value) rows, ``kidx`` [T, K] / ``cidx`` [T, E] int64 rows of each query's
window keys / visible entries (-1: none), ``sink`` [H] -> [T, H, D]: per (query, head) the
softmax over its keys with the head's sink in the denominator, times the keys.
"""

from __future__ import annotations

from dsv4_serving.kernels.build import CpuKernel


class V4AttnKernel(CpuKernel):
    name = "v4_attn"


V4_ATTN = V4AttnKernel()
"""The process's handle (resolved, and built if needed, on first use)."""
