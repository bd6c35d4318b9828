"""The mHC kernel (``mhc.cpp``): ``hc_pre(mixes, base, scale, streams, iters, hc_eps)`` and
``hc_post(out, streams, post, comb)``, each one call per layer instead of the torch chain's
~130 small ops (the Sinkhorn iterations). Same arithmetic in the same order as
``layers/mhc.py``'s torch path, which stays the fallback (no compiler, other dtypes) and the
oracle.

Contract: float32, contiguous, on the CPU; ``mixes`` [T, (2 + n) n] (the pre | post | comb
logits of ``F.linear``), ``base`` [(2 + n) n], ``scale`` [3], ``streams`` [T, n, D] ->
(collapsed [T, D], post [T, n], comb [T, n, n]); ``hc_post`` -> [T, n, D].
"""

from __future__ import annotations

from dsv4_serving.kernels.build import CpuKernel


class MHCKernel(CpuKernel):
    name = "mhc"


MHC = MHCKernel()
"""The process's handle (resolved, and built if needed, on first use)."""
