"""``dsv4 explain-model --tp --dp --ep``: the plan and its byte counts for dsv4-tiny, exactly.

dsv4-tiny in bf16: 2,176,524 parameters = 4,353,048 bytes, plus the int64 hash table of its
first layer (264 x 2 x 8 = 4,224 bytes). Of the parameters, 593,400 are replicated, 600,084
TP-sharded and 983,040 routed-expert weights.
"""

from __future__ import annotations

import pytest

from dsv4_common.cli import main
from dsv4_serving.distributed.topology import Topology
from dsv4_serving.models.config import DeepseekV4Config
from dsv4_serving.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsv4_serving.models.parallel_plan import parallel_plan
from dsv4_serving.presets.configs import preset_config

CFG = DeepseekV4Config.from_dict(preset_config("dsv4-tiny"))
WHOLE = 4_357_272


@pytest.mark.parametrize(
    ("topo", "per_rank"),
    [
        (Topology(), WHOLE),
        # (593,400 + 600,084 / 2 + 983,040 / 2) x 2 + 4,224 (EP off: experts split over TP)
        (Topology(tp=2), 2_774_148),
        # (593,400 + 600,084 / 2 + 983,040 / 4) x 2 + 4,224
        (Topology(tp=2, dp=2, ep=4), 2_282_628),
        # DP alone replicates every weight
        (Topology(dp=2), WHOLE),
    ],
)
def test_weight_bytes_per_rank_are_exact(topo: Topology, per_rank: int) -> None:
    plan = parallel_plan(DeepseekV4ForCausalLM, CFG, topo)
    assert (plan.weight_bytes_per_rank, plan.weight_bytes_total) == (per_rank, WHOLE)


def test_the_plan_names_how_each_tensor_is_held() -> None:
    plan = parallel_plan(DeepseekV4ForCausalLM, CFG, Topology(tp=2, dp=2, ep=4))
    by = {p.pattern: p for p in plan.tensors}
    assert (by["layers.*.attn.wq_b.weight"].kind, by["layers.*.attn.wq_b.weight"].local) == (
        "tp",
        (256, 64),
    )
    assert by["layers.*.attn.wo_b.weight"].local == (128, 64)
    assert by["layers.*.attn.attn_sink"].local == (2,)
    assert by["head.weight"].local == (132, 128)
    experts = by["layers.*.ffn.experts.w1"]
    assert (experts.kind, experts.logical, experts.local, experts.count) == (
        "ep",
        (8, 64, 128),
        (2, 64, 128),
        4,
    )
    for whole in (
        "layers.*.attn.wkv.weight",
        "layers.*.attn.compressor.wkv.weight",
        "layers.*.attn.indexer.wq_b.weight",
        "layers.*.hc_attn_fn",
        "layers.*.ffn.gate.weight",
    ):
        assert by[whole].kind == "replicated", whole


def test_explain_model_prints_the_plan_after_the_layers(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            ["explain-model", "dsv4-tiny", "--device", "cpu", "--tp", "2", "--dp", "2", "--ep", "4"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.index("4. layers") < out.index("5. parallel plan: tp 2 x dp 2 = 4 ranks")
    assert "layers.*.ffn.experts.w1 [8x64x128 -> 2x64x128] (x4)" in out
    assert "weight bytes (bf16) per rank: 2282628 (whole model 4357272)" in out
    assert "kv bytes (bf16) per rank: 26624 per 128-token block" in out


def test_explain_model_refuses_a_split_the_model_cannot_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["explain-model", "dsv4-tiny", "--device", "cpu", "--tp", "4"]) == 1
    assert "output groups (o_groups) 2 is not divisible by tp 4" in capsys.readouterr().err
