"""Context-parallel prefill on dsv4-tiny and dsv3-small (MLA) over 2 and 3 gloo ranks: a
step's prefill chunks split zig-zag over the ranks (one chunk with context in the cache, one
too short to split, decode rows beside them), the cache inputs (V4) or latent rows (MLA)
all-gathered per layer; every row's logits equal the single-process step's within
docs/models.md's bound (1e-4 of the logit scale), and each rank's ``CPStats`` counted every
gather (one per attention layer and step, plus the test's own of the output) and its bytes:
each row sent once, by its owner, and received by every other rank."""

from __future__ import annotations

import pytest

from dsv4_serving.distributed.cp_plan import CPModel
from dsv4_serving.models.config import DeepseekV3Config, DeepseekV4Config
from dsv4_serving.presets.configs import preset_config

from .cp_cases import STEPS, cp_logits, cp_mtp_logits
from .harness import run_ranks

pytestmark = pytest.mark.dist


def _row_bytes(preset: str) -> tuple[list[int], int]:
    """Bytes per token each attention layer gathers (float32), as the CP plan counts them,
    and per token of the test's own gather of the model's output (``cp_cases._run``)."""
    cfg = preset_config(preset)
    if cfg["architectures"][0] == "DeepseekV3ForCausalLM":
        model = CPModel.mla(DeepseekV3Config.from_dict(cfg), dtype_bytes=4)
    else:
        model = CPModel.v4(DeepseekV4Config.from_dict(cfg), dtype_bytes=4)
    out = 4 * model.hidden_size * model.streams
    return [layer.gathered * 4 for layer in model.layers], out


@pytest.mark.parametrize(
    ("preset", "world"), [("dsv4-tiny", 2), ("dsv4-tiny", 3), ("dsv3-small", 2), ("dsv3-small", 3)]
)
def test_cp_prefill_matches_one_process(preset: str, world: int) -> None:
    results = run_ranks(cp_logits, world=world, timeout=150, args=(preset,))
    per_layer, out = _row_bytes(preset)
    sent = [r["bytes_sent"] for r in results]
    rows = sum(n for step in STEPS for _, n in step)  # every step runs with a share
    assert sum(sent) == rows * (sum(per_layer) + out)  # each row sent once, by its owner
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        for case in ("step0", "step1", "step2"):
            assert r[case] <= 1.0, (rank, case, r[case])
        assert r["gathers"] == len(STEPS) * (len(per_layer) + 1)
        assert r["bytes_received"] == sum(sent) - r["bytes_sent"], (rank, sent)


@pytest.mark.parametrize("preset", ["dsv4-tiny", "dsv3-small"])
def test_cp_mtp_layer_matches_one_process(preset: str) -> None:
    """The MTP layer's pass over the prompt split like a layer (``CPForward.mtp_forward``):
    its draft logits on every row equal one process's, and the later steps, which read the
    MTP cache the split steps wrote, too."""
    results = run_ranks(cp_mtp_logits, world=2, timeout=150, args=(preset,))
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        for i in range(len(STEPS)):
            assert r[f"step{i}"] <= 1.0, (rank, i, r)
    total = sum(n for step in STEPS for _, n in step)
    assert results[0]["rows0"] + results[1]["rows0"] > total // len(STEPS)  # both checked rows
