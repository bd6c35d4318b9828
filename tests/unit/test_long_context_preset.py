"""The long-context tiny V4 preset: dsv4-tiny with V4's real compress ratios (CSA 4, HCA 128)
and 128K positions, so CPU tests and benchmarks can run prompts of 32K-128K tokens."""

from __future__ import annotations

import pytest

from dsv4_serving.models.config import DeepseekV4Config
from dsv4_serving.presets import preset_config

pytestmark = pytest.mark.unit


def test_dsv4_tiny_long_has_the_real_ratios_and_128k_positions() -> None:
    d = preset_config("dsv4-tiny-long")
    c = DeepseekV4Config.from_dict(d)
    assert (c.csa_ratio, c.hca_ratio) == (4, 128)
    assert [c.layer_ratio(i) for i in range(5)] == [0, 4, 128, 4, 0]
    assert d["max_position_embeddings"] == 131072
    yarn = d["rope_scaling"]
    assert yarn["factor"] * yarn["original_max_position_embeddings"] == 131072
    # the rest is dsv4-tiny's
    tiny = preset_config("dsv4-tiny")
    same = {
        k for k in tiny if k not in ("compress_rate_hca", "rope_scaling", "max_position_embeddings")
    }
    assert {k: d[k] for k in same} == {k: tiny[k] for k in same}
