"""The V4 attention kernel (``v4_attn.cpp``): ``v4_attn(q, ksrc, kidx, csrc, cidx, sink,
scale)``, one call per layer for a step's decode rows and one for its prefill rows, instead of
the torch path's gathers, score and mask tensors, softmax and products. Reads the key rows in
place and skips the keys a query does not see (outside its window, entries it did not select),
so a prefill chunk costs its window, not the whole chunk. The torch path
(``attention/v4.py``) stays the fallback (no compiler, other dtypes) and the oracle.

Contract: contiguous, on the CPU; ``q`` [T, H, D] float32 or bfloat16, ``ksrc`` [Rk, D] and
``csrc`` [Rc, D] the key (= value) rows, float32 or bfloat16 (one dtype for both, not
necessarily q's), ``kidx`` [T, K] / ``cidx`` [T, E] int64 rows of each query's window keys /
visible entries (-1: none), ``sink`` [H] and ``cos`` / ``sin`` float32 -> [T, H, D] in q's
dtype: per (query, head) the softmax over its keys with the head's sink in the denominator,
times the keys, in float32 (bfloat16 rows widened per vector, the output rounded once).
``rope_tail(x, cos, sin, inverse)`` takes float32 or bfloat16 ``x``.
"""

from __future__ import annotations

import torch

from dsv4_serving.kernels.build import CpuKernel


class V4AttnKernel(CpuKernel):
    name = "v4_attn"
    dtypes = (torch.float32, torch.bfloat16)


V4_ATTN = V4AttnKernel()
"""The process's handle (resolved, and built if needed, on first use)."""
