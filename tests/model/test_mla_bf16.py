"""MLA's prefill expansion with a low-precision ``wkv_b`` (bfloat16 models on CPU): through the
float32 halves the layer already keeps (no conversion of the matrix per chunk and layer), equal
to the float32 product of the same weight within float32 rounding; a float32 weight is used as
it is (its tokens unchanged)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4_serving.models.config import DeepseekV3Config
from dsv4_serving.models.deepseek_v3 import DeepseekV3ForCausalLM
from dsv4_serving.presets import preset_config

pytestmark = pytest.mark.model


def attention(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    m = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(preset_config("dsv3-small")))
    attn = m.layers[0].attn
    g = torch.Generator().manual_seed(0)
    w = torch.randn(attn.wkv_b.weight.shape, generator=g) * 0.05
    attn.wkv_b.weight.data = w.to(dtype)
    return attn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_expansion_matches_float32_product(dtype: torch.dtype) -> None:
    attn = attention(dtype)
    lat = torch.randn(37, attn.kv_lora, generator=torch.Generator().manual_seed(1))
    k, v = attn.expand(lat)
    h, nope, dv = attn.n_heads, attn.nope, attn.v_dim
    ref = F.linear(lat.double(), attn.wkv_b.weight.double()).view(37, h, nope + dv)
    assert k.dtype == v.dtype == torch.float32
    assert k.shape == (37, h, nope) and v.shape == (37, h, dv)
    # the weight's values are exact in float32: only the float32 sums' rounding differs
    torch.testing.assert_close(k.double(), ref[..., :nope], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.double(), ref[..., nope:], rtol=1e-5, atol=1e-5)


def test_float32_expansion_is_the_plain_product() -> None:
    attn = attention(torch.float32)
    lat = torch.randn(21, attn.kv_lora, generator=torch.Generator().manual_seed(2))
    k, v = attn.expand(lat)
    kv = F.linear(lat, attn.wkv_b.weight).view(21, attn.n_heads, -1)
    assert torch.equal(k, kv[..., : attn.nope]) and torch.equal(v, kv[..., attn.nope :])
