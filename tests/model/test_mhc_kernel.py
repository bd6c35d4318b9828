"""The mHC CPU kernel against the torch chain it replaces (``layers/mhc.py``): gates, the
Sinkhorn-normalised mix and the collapse of ``hc_pre``, and ``hc_post``, on random streams of
V4's shape (4 streams, 20 iterations), within float32 rounding; a token's result does not depend
on the rest of the batch; and the layer functions take the kernel on CPU float32 and bfloat16.

bfloat16 streams: the kernel's result is bit for bit its float32 result on the same (widened)
values, rounded once, in every build (AVX-512, AVX2 and scalar), and the AVX-512 and AVX2
builds agree bit for bit (the scalar one has no FMA); against the torch
chain, which rounds its bfloat16 matmul and sums at each step, within 2^-7 of the largest
value; and nearer than the torch chain to the exact result."""

from __future__ import annotations

import pytest
import torch

import dsv4_serving.layers.mhc as mhc
from dsv4_serving.kernels.build import available, build
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


def builds() -> list:  # type: ignore[type-arg]
    """The default build, the AVX2 one (on an AVX-512 machine) and the scalar one (a CPU
    without AVX2, and the vector loops' tails)."""
    if not available("mhc"):
        pytest.fail("the mhc kernel does not build here (g++ and ninja: make install)")
    exts = [build("mhc")]
    variants = ("avx2", "scalar") if exts[0].path == "avx512" else ("scalar",)
    return exts + [build("mhc", v) for v in variants if available("mhc", v)]


@pytest.mark.parametrize("t,d", [(1, 96), (7, 101), (64, 96)])
def test_bf16_is_the_float32_kernel_rounded_once(t: int, d: int) -> None:
    g = torch.Generator().manual_seed(t)
    streams = torch.randn(t, N, d, generator=g).bfloat16()
    out = torch.randn(t, d, generator=g).bfloat16()
    mixes = torch.randn(t, (2 + N) * N, generator=g)
    base = torch.randn((2 + N) * N, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    fma: list[tuple[torch.Tensor, ...]] = []
    for ext in builds():
        x, post, comb = ext.hc_pre(mixes, base, scale, streams, ITERS, EPS)
        x32, post32, comb32 = ext.hc_pre(mixes, base, scale, streams.float(), ITERS, EPS)
        assert x.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
        assert torch.equal(x, x32.bfloat16()), ext.path
        assert torch.equal(post, post32) and torch.equal(comb, comb32), ext.path
        new = ext.hc_post(out, streams, post, comb)
        new32 = ext.hc_post(out.float(), streams.float(), post, comb)
        assert new.dtype == torch.bfloat16 and torch.equal(new, new32.bfloat16()), ext.path
        with pytest.raises(ValueError, match="one dtype"):
            ext.hc_post(out.float(), streams, post, comb)
        if ext.path != "scalar":
            fma.append((x, post, comb, new, x32, new32))
    for other in fma[1:]:
        assert all(torch.equal(a, b) for a, b in zip(fma[0], other, strict=True))


def test_bf16_against_the_torch_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    streams, fn, base, scale, out = (y.bfloat16() for y in inputs(33, seed=3))
    fn, base, scale = fn.float(), base.float(), scale.float()
    assert mhc.MHC.get(streams) is not None  # bfloat16 takes the kernel

    def run() -> tuple[torch.Tensor, ...]:
        x, post, comb = mhc.hc_pre(streams, fn, base, scale, ITERS, EPS, 1e-6)
        return x, post, comb, mhc.hc_post(out, streams, post, comb)

    kernel = run()
    monkeypatch.setattr(mhc, "MHC", MHCKernel(use_kernel=False))
    torch_path = run()
    for k, r in zip(kernel, torch_path, strict=True):
        assert k.shape == r.shape and k.dtype == r.dtype
        assert (k.float() - r.float()).abs().max() <= 2**-7 * float(r.float().abs().max())
    # the exact new streams from the same gates, in float64: the kernel rounds once
    post, comb = kernel[1].double(), kernel[2].double()
    exact = (
        torch.einsum("tja,tjd->tad", comb, streams.double())
        + post[..., None] * out.double()[:, None]
    )
    err_kernel = (kernel[3].double() - exact).abs().mean()
    err_torch = (torch_path[3].double() - exact).abs().mean()
    assert err_kernel < err_torch
    assert (kernel[3].double() - exact).abs().max() <= 2**-8 * float(exact.abs().max())


def test_bf16_weights_are_converted_once_and_again_when_they_change() -> None:
    fn = torch.randn((2 + N) * N, N * D).bfloat16()
    first = mhc._float32(fn)
    assert first.dtype == torch.float32 and torch.equal(first, fn.float())
    assert mhc._float32(fn) is first
    fn.mul_(2)  # a weight loaded in place
    again = mhc._float32(fn)
    assert again is not first and torch.equal(again, fn.float())
    f32 = torch.randn(3)
    assert mhc._float32(f32) is f32
