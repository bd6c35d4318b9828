# DeepSeek's special tokens are spelled with fullwidth bars and U+2581 on purpose.
# ruff: noqa: RUF001, RUF003
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4_serving.models.config import DeepseekV3Config, DeepseekV4Config
from dsv4_serving.presets import PRESETS, build_tokenizer, preset_config, write_preset


def test_byte_tokenizer_round_trips_any_text_and_keeps_specials() -> None:
    tok = build_tokenizer()
    text = "héllo, 世界 <｜User｜>hi<｜Assistant｜>"
    ids = tok.encode(text).ids
    assert ids[:1] == [ord("h")]
    assert 258 in ids and 259 in ids  # <｜User｜>, <｜Assistant｜> as single tokens
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_preset_directory_is_a_loadable_checkpoint_layout(tmp_path: Path) -> None:
    write_preset("dsv4-tiny", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    assert "<｜Assistant｜>" in tc["chat_template"]
    assert (tmp_path / "tokenizer.json").is_file()


def test_dsv4_tiny_exercises_every_v4_mechanism_within_256_tokens() -> None:
    c = DeepseekV4Config.from_dict(preset_config("dsv4-tiny"))
    ratios = c.compress_ratios[: c.num_hidden_layers]
    assert 0 in ratios and c.csa_ratio in ratios and c.hca_ratio in ratios
    assert 256 // c.hca_ratio >= 4  # several HCA blocks in a 256-token prompt
    assert c.index_topk < 256 // c.csa_ratio  # the indexer really selects
    assert 0 < c.num_hash_layers < c.num_hidden_layers  # hash- and bias-routed layers
    assert c.num_nextn_predict_layers == 1


def test_dsv3_small_has_the_mla_dims_vllm_cpu_accepts() -> None:
    c = DeepseekV3Config.from_dict(preset_config("dsv3-small"))
    assert c.kv_lora_rank == 512 and c.qk_rope_head_dim == 64


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="dsv4-tiny"):
        preset_config("nope")
    assert set(PRESETS) >= {"dsv4-tiny", "dsv3-small"}
