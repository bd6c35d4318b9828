"""The mHC kernel (``mhc.cpp``): ``hc_pre(mixes, base, scale, streams, iters, hc_eps)`` and
``hc_post(out, streams, post, comb)``, each one call per layer instead of the torch chain's
~130 small ops (the Sinkhorn iterations). Same arithmetic in the same order as
``layers/mhc.py``'s torch path, which stays the fallback (no compiler, other dtypes) and the
oracle.

Contract: contiguous, on the CPU; ``mixes`` [T, (2 + n) n] (the pre | post | comb logits of
``F.linear``), ``base`` [(2 + n) n], ``scale`` [3] float32, ``streams`` [T, n, D] float32 or
bfloat16 -> (collapsed [T, D] in the streams' dtype, post [T, n], comb [T, n, n] float32);
``hc_post(out, streams, post, comb)`` with ``out`` [T, D] in the streams' dtype -> [T, n, D] in
it. bfloat16 is widened per vector, summed in float32 and rounded once.
"""

from __future__ import annotations

import torch

from dsv4_serving.kernels.build import CpuKernel


class MHCKernel(CpuKernel):
    name = "mhc"
    dtypes = (torch.float32, torch.bfloat16)


MHC = MHCKernel()
"""The process's handle (resolved, and built if needed, on first use)."""
