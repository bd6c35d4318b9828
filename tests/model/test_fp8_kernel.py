"""The fp8 CPU kernel: its dequantized weights are the torch path's exactly (every e4m3 byte
but NaN), its products those of the dequantized matrix up to float32 summation order (checked
against float64: 1e-5 of the output scale, measured ~3e-7), on ragged blocks, expert indices
and 3-D inputs; and the quant method uses it on CPU for float32."""

from __future__ import annotations

import pytest
import torch

from dsv4_serving.kernels.build import available, build
from dsv4_serving.layers.linear import ReplicatedLinear
from dsv4_serving.layers.moe import Experts
from dsv4_serving.layers.quant.methods import Fp8Block
from dsv4_serving.loader.dummy import init_dummy_weights

pytestmark = pytest.mark.model
TOL = 1e-5


def ext():  # type: ignore[no-untyped-def]
    if not available("fp8"):
        pytest.fail("the fp8 kernel does not build here (g++ and ninja: make install)")
    return build("fp8")


def test_every_e4m3_byte_decodes_to_the_torch_value() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    w = codes[(codes & 0x7F) != 0x7F].view(1, -1).view(torch.float8_e4m3fn)  # NaNs left out
    got = ext().fp8_linear(torch.eye(w.shape[1]), w, torch.ones(1, 2), 128, 128)[:, 0]
    assert torch.equal(got, w.float()[0])


@pytest.mark.parametrize("m", [1, 2, 3, 16, 33])
def test_products_are_the_dequantized_matrixs(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    for k, n, block in [(300, 330, (128, 128)), (129, 7, (128, 128)), (256, 96, (32, 64))]:
        f8 = Fp8Block(block)
        layer = ReplicatedLinear(k, n, f8)
        init_dummy_weights(torch.nn.Sequential(layer), seed=1)
        x = torch.randn(m, k, generator=g)
        want = x.double() @ f8.dequantized(layer, "weight").double().t()
        got = ext().fp8_linear(x, layer.weight, layer.weight_scale, *block)
        assert float((got.double() - want).abs().max() / want.abs().max()) < TOL, (k, n)
        assert torch.equal(layer(x), got)  # the method's path on CPU


def test_experts_3d_inputs_and_the_fallback() -> None:
    f8, slow = Fp8Block(), Fp8Block(use_kernel=False)
    ex = Experts(3, 256, 128, quant=f8)
    init_dummy_weights(torch.nn.Sequential(ex), seed=2)
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(3))
    for e in range(3):
        got = f8.matmul(ex, "w2", x[..., :128], e)
        want = slow.matmul(ex, "w2", x[..., :128], e)
        assert got.shape == (2, 5, 256)
        assert float((got - want).abs().max() / want.abs().max()) < TOL
    assert f8.kernel.get(x.bfloat16()) is None and slow.kernel.get(x) is None
    with pytest.raises(RuntimeError, match="index 3 out of 3"):
        ext().fp8_linear(x[0], ex.w1, ex.w1_scale, 128, 128, 3)
