"""The W8A8 CPU kernel computes bitwise what the pure-torch path computes (per-token
quantization, ``torch._int_mm``, the two scales in the same order): integer accumulation is
exact and every float step is the same IEEE operation. Checked on random shapes (odd K and N,
M from 1 to 64 and a prefill-sized M), float32 and bfloat16 activations, weights with -128,
strided rows and expert views, a shared TP scale; for the native build and, on an AVX-512
machine, the AVX2 build too. Then the quant method uses it by default on CPU, for linears and
experts, with the torch path's results."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from dsv4_serving.kernels import build as build_mod
from dsv4_serving.kernels.build import available, build
from dsv4_serving.layers.linear import ReplicatedLinear
from dsv4_serving.layers.moe import Experts
from dsv4_serving.layers.quant.methods import W8A8, int8_mm, quantize_per_token, token_scale
from dsv4_serving.loader.dummy import init_dummy_weights

pytestmark = pytest.mark.model
MS = [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 33, 64]
KN = [(1, 1), (31, 5), (64, 9), (65, 4), (127, 3), (256, 130), (513, 77), (1000, 16)]


def oracle(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, xs: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
    if xs is None:
        xq, xs = quantize_per_token(x)
    else:
        xq = (x.float() / xs).round_().clamp_(-127, 127).to(torch.int8)
    return (int8_mm(xq, w.t()).float() * xs * s).to(x.dtype)


def builds() -> list[ModuleType]:
    if not available("w8a8"):
        pytest.fail("the W8A8 kernel does not build here (g++ and ninja: make install)")
    exts = [build("w8a8")]
    if exts[0].path != "avx2" and available("w8a8", "avx2"):
        exts.append(build("w8a8", "avx2"))
    return exts


def test_the_kernel_is_bitwise_the_torch_path_on_random_shapes() -> None:
    g = torch.Generator().manual_seed(0)
    for ext in builds():
        for m in [*MS, 300]:
            for k, n in KN:
                for dtype in (torch.float32, torch.bfloat16):
                    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
                    x[0, : k // 2] = 0  # a partly zero row; all-zero rows below
                    if m > 2:
                        x[2] = 0
                    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
                    s = torch.rand(n, generator=g) / 100
                    got = ext.w8a8_linear(x, w, s)
                    assert got.dtype == dtype and got.shape == (m, n)
                    assert torch.equal(got, oracle(x, w, s)), (ext.path, m, k, n, dtype)


def test_strided_rows_expert_views_and_a_shared_scale() -> None:
    g = torch.Generator().manual_seed(1)
    for ext in builds():
        big = torch.randn(9, 300, generator=g)
        x = big[:, 10:267]  # rows 300 apart, K = 257
        stacked = torch.randint(-127, 128, (3, 70, 257), dtype=torch.int8, generator=g)
        s = torch.rand(3, 70, generator=g)
        for e in range(3):
            want = oracle(x, stacked[e], s[e])
            assert torch.equal(ext.w8a8_linear(x, stacked[e], s[e]), want)
            assert torch.equal(ext.w8a8_linear(x, stacked, s, None, e), want)  # picked in C++
        x3 = x.reshape(3, 3, 257)  # leading dims kept
        assert torch.equal(
            ext.w8a8_linear(x3, stacked[1], s[1]), oracle(x, stacked[1], s[1]).view(3, 3, 70)
        )
        xs = token_scale(big)  # a whole-row scale, as a TP row split shares it
        assert torch.equal(
            ext.w8a8_linear(x, stacked[0], s[0], xs), oracle(x, stacked[0], s[0], xs)
        )
        assert ext.w8a8_linear(x[:0], stacked[0], s[0]).shape == (0, 70)


def test_bad_arguments_are_clear_errors() -> None:
    (ext, *_) = builds()
    w = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="x's K"):
        ext.w8a8_linear(torch.zeros(2, 9), w, torch.ones(4))
    with pytest.raises(RuntimeError, match="one scale per output row"):
        ext.w8a8_linear(torch.zeros(2, 8), w, torch.ones(3))
    with pytest.raises(RuntimeError, match="index 4 out of 4 stacked"):
        ext.w8a8_linear(torch.zeros(2, 8), w.expand(4, 4, 8), torch.ones(4, 4), None, 4)
    with pytest.raises(RuntimeError, match="with an index"):
        ext.w8a8_linear(torch.zeros(2, 8), w.expand(4, 4, 8), torch.ones(4, 4))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ext.w8a8_linear(torch.zeros(2, 8, dtype=torch.float16), w, torch.ones(4))


def test_the_quant_method_uses_the_kernel_on_cpu_with_the_torch_paths_results() -> None:
    builds()
    fast, slow = W8A8(), W8A8(use_kernel=False)
    x = torch.randn(6, 200, generator=torch.Generator().manual_seed(2))
    assert fast.kernel.get(x) is not None and slow.kernel.get(x) is None
    assert fast.kernel.get(x.half()) is None  # float16: the torch path
    layers = [ReplicatedLinear(200, 90, m) for m in (fast, slow)]
    experts = [Experts(4, 200, 48, quant=m) for m in (fast, slow)]
    for mod in (*layers, *experts):
        init_dummy_weights(torch.nn.Sequential(mod), seed=3)
    assert torch.equal(layers[0](x), layers[1](x))
    idx = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 1], [0, 3], [1, 1]])
    wts = torch.rand(6, 2, generator=torch.Generator().manual_seed(4))
    assert torch.equal(experts[0](x, idx, wts), experts[1](x, idx, wts))


def test_without_the_kernel_the_method_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_mod, "available", lambda name, variant="": False)
    method = W8A8()
    layer = ReplicatedLinear(64, 32, method)
    init_dummy_weights(torch.nn.Sequential(layer), seed=5)
    x = torch.randn(3, 64)
    assert method.kernel.get(x) is None
    assert torch.equal(layer(x), oracle(x, layer.weight, layer.weight_scale))
