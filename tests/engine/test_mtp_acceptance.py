"""MTP drafts are accepted when they are right: a checkpoint whose next token depends only on
the current one (attention and FFN outputs zeroed, so every block passes its streams through)
and whose MTP layer computes the same function must accept (nearly) every draft, and still
give exactly the tokens of decoding without drafts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine_core import EngineCore
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.models.registry import REGISTRY
from dsv4_serving.presets import preset_config, write_preset

from .common import alone, run, workload


def _pass_through_checkpoint(path: Path) -> None:
    from safetensors.torch import save_file

    write_preset("dsv4-tiny", path)
    cfg = preset_config("dsv4-tiny")
    cls = REGISTRY.resolve(cfg["architectures"][0])
    model = cls(cls.config_class.from_dict(cfg))
    init_dummy_weights(model, seed=3)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for k in sd:
        if k.endswith(("attn.wo_b.weight", "ffn.experts.w2", "shared_experts.w2.weight")):
            sd[k].zero_()
    sd["mtp.0.e_proj.weight"] = torch.eye(cfg["hidden_size"])
    sd["mtp.0.h_proj.weight"].zero_()
    sd["mtp.0.enorm.weight"].fill_(1.0)
    sd["mtp.0.norm.weight"] = sd["norm.weight"].clone()
    save_file(sd, str(path / "model.safetensors"))


@pytest.mark.parametrize("k", [1, 3])
def test_right_drafts_are_accepted_and_tokens_unchanged(tmp_path: Path, k: int) -> None:
    _pass_through_checkpoint(tmp_path)
    base = EngineConfig(
        model=str(tmp_path), max_model_len=256, num_kv_blocks=400, num_speculative_tokens=0
    )
    work = workload(8, 3)
    want = alone(replace(base, max_num_seqs=1, enable_prefix_caching=False), work)
    core = EngineCore(replace(base, num_speculative_tokens=k))
    got = run(core, work)
    assert got == want
    st = core.stats()
    assert st.spec_accepted_tokens / st.spec_draft_tokens > 0.9
    assert core.kv.num_free_blocks == 400
