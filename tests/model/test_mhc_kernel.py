"""The mHC CPU kernel against the torch chain it replaces (``layers/mhc.py``): gates, the
Sinkhorn-normalised mix and the collapse of ``hc_pre``, and ``hc_post``, on random streams of
V4's shape (4 streams, 20 iterations), within float32 rounding; a token's result does not depend
on the rest of the batch; and the layer functions take the kernel on CPU float32."""

from __future__ import annotations

import pytest
import torch

import dsv4_serving.layers.mhc as mhc
from dsv4_serving.kernels.build import available
from dsv4_serving.kernels.mhc import MHCKernel

pytestmark = pytest.mark.model
N, D, ITERS, EPS = 4, 96, 20, 1e-6


def inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(t, N, D, generator=g)
    fn = torch.randn((2 + N) * N, N * D, generator=g) * 0.05
    base = torch.randn((2 + N) * N, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    out = torch.randn(t, D, generator=g)
    return streams, fn, base, scale, out


def both(monkeypatch: pytest.MonkeyPatch, t: int, seed: int = 0) -> tuple[tuple, tuple]:  # type: ignore[type-arg]
    if not available("mhc"):
        pytest.fail("the mhc kernel does not build here (g++ and ninja: make install)")
    streams, fn, base, scale, out = inputs(t, seed)

    def run() -> tuple[torch.Tensor, ...]:
        x, post, comb = mhc.hc_pre(streams, fn, base, scale, ITERS, EPS, 1e-6)
        return x, post, comb, mhc.hc_post(out, streams, post, comb)

    kernel = run()
    monkeypatch.setattr(mhc, "MHC", MHCKernel(use_kernel=False))
    return kernel, run()


@pytest.mark.parametrize("t", [1, 7, 64])
def test_kernel_matches_the_torch_chain(monkeypatch: pytest.MonkeyPatch, t: int) -> None:
    kernel, torch_path = both(monkeypatch, t, seed=t)
    for k, r in zip(kernel, torch_path, strict=True):
        assert k.shape == r.shape and k.dtype == r.dtype
        assert (k - r).abs().max() <= 1e-5 * max(1.0, float(r.abs().max()))
    comb = kernel[2]
    # Sinkhorn made it (nearly) doubly stochastic: not a pass-through of the softmax
    assert (comb.sum(dim=-2) - 1).abs().max() < 1e-3
    assert (comb.sum(dim=-1) - 1).abs().max() < 1e-2


def test_kernel_is_used_on_cpu_float32_and_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    streams, fn, base, scale, _ = inputs(16)
    seen: list[torch.Tensor] = []
    real = mhc.MHC.get(streams)
    assert real is not None

    class Spy:
        def hc_pre(self, mixes, *a):  # type: ignore[no-untyped-def]
            seen.append(mixes)
            return real.hc_pre(mixes, *a)

    monkeypatch.setattr(mhc.MHC, "get", lambda x: Spy())
    whole = mhc.hc_pre(streams, fn, base, scale, ITERS, EPS, 1e-6)
    assert len(seen) == 1
    # the same token alone (its mixing row as the batch computed it) gives the same bits
    one = real.hc_pre(seen[0][5:6].contiguous(), base, scale, streams[5:6], ITERS, EPS)
    for a, b in zip(whole, one, strict=True):
        assert torch.equal(a[5:6], b)
