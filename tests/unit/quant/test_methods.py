"""Quant methods against their dequantized oracle, exact where the maths is (fp8, fp4: the
same products; W8A8: the same int8 values), and the specs of scales under tensor and expert
parallelism."""

from __future__ import annotations

import pytest
import torch

from dsv4_serving.distributed.groups import Group, ModelParallel
from dsv4_serving.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from dsv4_serving.layers.moe import Experts
from dsv4_serving.layers.quant import methods
from dsv4_serving.layers.quant.methods import (
    W8A8,
    Fp4Experts,
    Fp8Block,
    QuantError,
    QuantMethod,
    cast_model,
    quantize_per_token,
)
from dsv4_serving.layers.shard import ShardSpec, shard_specs
from dsv4_serving.loader.quant import dequant_fp4, dequant_fp8_block

pytestmark = pytest.mark.unit


def _filled(layer: torch.nn.Module, method: QuantMethod, name: str, w: torch.Tensor) -> None:
    with torch.no_grad():
        for k, v in method.quantize(name, w).items():
            layer.get_parameter(k).copy_(v)


def test_fp8_blocks_dequantize_a_chunk_of_rows_at_a_time_into_one_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(methods, "SCRATCH_ELEMS", 128 * 300)  # one block row per chunk
    fp8 = Fp8Block((128, 128), use_kernel=False)  # the torch path (the kernel: test_fp8_kernel)
    layer = ReplicatedLinear(300, 330, fp8)  # ragged blocks on both dims
    _filled(layer, fp8, "weight", torch.randn(330, 300, generator=torch.Generator().manual_seed(0)))
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (3, 3)
    want = dequant_fp8_block(layer.weight, layer.weight_scale, torch.float32)
    assert torch.equal(fp8.dequantized(layer, "weight"), want)
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    # the same products summed in another blocking: float32 rounding of outputs of order 10
    torch.testing.assert_close(layer(x), x @ want.t(), rtol=1e-5, atol=1e-4)
    buf = fp8._scratch[(x.device, x.dtype)]
    layer(torch.randn(2, 300))
    assert fp8._scratch[(x.device, x.dtype)] is buf and buf.numel() == 128 * 300


def test_fp4_experts_unpack_two_codes_per_byte_with_an_e8m0_scale_per_32() -> None:
    fp4 = Fp4Experts()
    ex = Experts(4, 64, 96, quant=fp4)
    w1 = torch.randn(4, 96, 64, generator=torch.Generator().manual_seed(1))
    _filled(ex, fp4, "w1", w1)
    assert ex.w1.shape == (4, 96, 32) and ex.w1.dtype == torch.uint8
    assert ex.w1_scale.shape == (4, 96, 2) and ex.w1_scale.dtype == torch.uint8
    want = dequant_fp4(ex.w1[2], ex.w1_scale[2], torch.float32)
    assert torch.equal(fp4.dequantized(ex, "w1", 2), want)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fp4.matmul(ex, "w1", x, 2), x @ want.t(), rtol=1e-5, atol=1e-4)


def test_w8a8_is_the_int8_product_of_per_token_activations_and_per_channel_weights() -> None:
    w8 = W8A8()
    layer = ReplicatedLinear(256, 384, w8)
    w = torch.randn(384, 256, generator=torch.Generator().manual_seed(2)) / 16
    _filled(layer, w8, "weight", w)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (384,)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    xq, xs = quantize_per_token(x)
    simulated = (xq.float() * xs) @ w8.dequantized(layer, "weight").t()
    y = layer(x)
    torch.testing.assert_close(y, simulated, rtol=1e-5, atol=1e-4)
    # against the float weights: int8 rounding of both operands, well under 2%
    assert float((y - x @ w.t()).norm() / (x @ w.t()).norm()) < 0.02


def test_fp8_scales_shard_with_their_weights_under_tp() -> None:
    fp8 = Fp8Block((128, 128))
    col = ColumnParallelLinear(256, 512, Group((0, 1), 1), fp8)
    assert col.weight.shape == (256, 256) and col.weight_scale.shape == (2, 2)
    assert col.shards["weight_scale"] == ShardSpec(0, 2, 2, 4)
    row = RowParallelLinear(512, 256, Group((0, 1), 1), quant=fp8)
    assert row.shards["weight_scale"] == ShardSpec(1, 2, 2, 4)
    with pytest.raises(QuantError, match="splits of quantized weights must be multiples of 128"):
        ColumnParallelLinear(256, 128, Group((0, 1), 0), fp8)


def test_expert_scales_follow_ep_blocks_and_tp_slices() -> None:
    ep = ModelParallel(tp=Group((0, 1), 1), ep=Group((0, 1), 1))
    specs = shard_specs(Experts(8, 64, 64, parallel=ep, quant=W8A8()))
    assert specs["w2_scale"] == ShardSpec(0, 4, 4, 8) == specs["w1"]
    tp = ModelParallel(tp=Group((0, 1), 1))
    specs = shard_specs(Experts(8, 64, 64, parallel=tp, quant=Fp4Experts()))
    assert specs["w1_scale"] == ShardSpec(1, 32, 32, 64)  # output rows: as the weight
    assert specs["w2"] == ShardSpec(2, 16, 16, 32)  # split inputs: packed pairs
    assert specs["w2_scale"] == ShardSpec(2, 1, 1, 2)  # and 32-wide scale blocks
    specs = shard_specs(Experts(8, 64, 64, parallel=tp, quant=W8A8()))
    assert "w2_scale" not in specs and specs["w1_scale"] == ShardSpec(1, 32, 32, 64)


def test_casting_a_model_leaves_stored_formats_alone() -> None:
    layer = torch.nn.Sequential(ReplicatedLinear(128, 128, Fp8Block()), ReplicatedLinear(8, 8))
    cast_model(layer, torch.bfloat16)
    assert layer[0].weight.dtype == torch.float8_e4m3fn
    assert layer[0].weight_scale.dtype == torch.float32
    assert layer[1].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("method", [Fp8Block((32, 32)), W8A8()], ids=["fp8", "w8a8"])
def test_tp_slices_of_a_quantized_linear_recombine_to_the_whole(
    method: QuantMethod, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Column: the ranks' outputs side by side; row: their partial sums added (the all-reduce).
    W8A8 rows share the per-token scale of the whole row (an all-gather of each rank's amax,
    played here by both slices' amax), so the int8 products are the single-process ones."""
    from dsv4_serving.loader.dummy import init_dummy_weights

    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    gathered: list[torch.Tensor] = []

    def all_gather(amax: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
        gathered.append(amax)
        halves = (x[:, :64], x[:, 64:])
        return torch.cat([h.abs().amax(dim=-1, keepdim=True) for h in halves], dim=dim)

    monkeypatch.setattr(methods, "all_gather", all_gather)
    for kind in ("column", "row"):

        def make(group: Group, kind: str = kind) -> torch.nn.Module:
            if kind == "column":
                return torch.nn.Sequential(ColumnParallelLinear(128, 128, group, method))
            return torch.nn.Sequential(
                RowParallelLinear(128, 128, group, reduce=False, quant=method)
            )

        full = make(Group((0,), 0))
        init_dummy_weights(full, seed=1)
        parts = [make(Group((0, 1), r)) for r in (0, 1)]
        for p in parts:
            init_dummy_weights(p, seed=1)
        if kind == "column":
            got = torch.cat([p(x) for p in parts], dim=-1)
        else:
            got = parts[0](x[:, :64]) + parts[1](x[:, 64:])
        want = full(x)
        assert float((got - want).norm() / want.norm()) < 1e-5, kind
    assert len(gathered) == (2 if isinstance(method, W8A8) else 0)  # the two row ranks
