"""Weight loading from tiny checkpoints written here: sharded native names with fp8/fp4,
transformers' names, errors naming the tensor, dummy weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsv4_serving.loader.names import to_transformers_state_dict
from dsv4_serving.loader.quant import quantize_fp4, quantize_fp8_block
from dsv4_serving.loader.weights import WeightLoadError, load_weights
from dsv4_serving.models.config import DeepseekV4Config
from dsv4_serving.models.deepseek_v4 import DeepseekV4ForCausalLM

from .v4_common import ARCH, build_ours, tiny_v4_dict

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _fresh(d: dict) -> DeepseekV4ForCausalLM:  # type: ignore[type-arg]
    return DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(d)).float()


def _fp8_expected(q: torch.Tensor, scale: torch.Tensor, e8m0: bool) -> torch.Tensor:
    out = q.float().clone()
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            s = 2.0 ** (int(scale[bi, bj]) - 127) if e8m0 else float(scale[bi, bj])
            out[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128] *= s
    return out


def _fp4_expected(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows = []
    for r in range(packed.shape[0]):
        vals = []
        for byte in packed[r].view(torch.uint8).tolist():
            vals += [E2M1[byte & 0xF], E2M1[byte >> 4]]
        rows.append(vals)
    v = torch.tensor(rows)
    block = v.shape[1] // scale.shape[1]
    return v * torch.exp2(scale.float() - 127).repeat_interleave(block, dim=1)


def _write_sharded(tensors: dict[str, torch.Tensor], root: Path, shards: int) -> None:
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        part = {n: tensors[n].contiguous() for n in names[k::shards]}
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(root / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_native_sharded_fp8_fp4_checkpoint_dequantizes_at_load(tmp_path: Path) -> None:
    d = tiny_v4_dict()
    src = build_ours(d, seed=4)
    expected = {k: v.clone() for k, v in src.state_dict().items()}
    ckpt: dict[str, torch.Tensor] = {}
    for name, t in src.state_dict().items():
        m = name.endswith(("ffn.experts.w1", "ffn.experts.w2", "ffn.experts.w3"))
        if m:  # native per-expert fp4 tensors, two values per int8, e8m0 scale per 32
            stem, part = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                packed, scale = quantize_fp4(t[e])
                ckpt[f"{stem}.{e}.{part}.weight"] = packed
                ckpt[f"{stem}.{e}.{part}.scale"] = scale
                expected[name][e] = _fp4_expected(packed, scale)
        elif name.endswith("attn.wq_b.weight"):  # V4-style e8m0 `.scale`
            q, s = quantize_fp8_block(t, e8m0=True)
            ckpt[name], ckpt[name[: -len("weight")] + "scale"] = q, s
            expected[name] = _fp8_expected(q, s, e8m0=True)
        elif name.endswith("attn.wkv.weight"):  # V3-style float32 `weight_scale_inv`
            q, s = quantize_fp8_block(t, e8m0=False)
            ckpt[name], ckpt[name + "_scale_inv"] = q, s
            expected[name] = _fp8_expected(q, s, e8m0=False)
        else:
            ckpt[name] = t
    _write_sharded(ckpt, tmp_path, shards=3)
    model = _fresh(d)
    load_weights(model, tmp_path, ARCH, d["num_hidden_layers"], threads=3)
    got = model.state_dict()
    for name, want in expected.items():
        assert torch.equal(got[name], want), name
    assert not torch.equal(
        got["layers.0.ffn.experts.w1"], src.state_dict()["layers.0.ffn.experts.w1"]
    )


def test_transformers_names_load_to_the_same_model(tmp_path: Path) -> None:
    d = tiny_v4_dict(num_nextn_predict_layers=0)
    src = build_ours(d, seed=6)
    save_file(
        {k: v.contiguous() for k, v in to_transformers_state_dict(src.state_dict(), ARCH).items()},
        str(tmp_path / "model.safetensors"),
    )
    model = _fresh(d)
    load_weights(model, tmp_path, ARCH, d["num_hidden_layers"])
    for name, want in src.state_dict().items():
        assert torch.equal(model.state_dict()[name], want), name


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    d = tiny_v4_dict()
    sd = {k: v.contiguous() for k, v in build_ours(d, seed=7).state_dict().items()}
    sd.pop("layers.2.attn.compressor.ape")
    sd["layers.0.attn.not_a_thing.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError) as exc:
        load_weights(_fresh(d), tmp_path, ARCH, d["num_hidden_layers"])
    msg = str(exc.value)
    assert "layers.2.attn.compressor.ape" in msg and "layers.0.attn.not_a_thing.weight" in msg


def test_an_absent_expert_is_named(tmp_path: Path) -> None:
    d = tiny_v4_dict(num_nextn_predict_layers=0)
    ckpt = {}
    for name, t in build_ours(d, seed=8).state_dict().items():
        if name.endswith("ffn.experts.w2"):
            stem = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                if not (name.startswith("layers.1.") and e == 5):
                    ckpt[f"{stem}.{e}.w2.weight"] = t[e].contiguous()
        else:
            ckpt[name] = t.contiguous()
    save_file(ckpt, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"layers\.1\.ffn\.experts\.w2 \(experts \[5\]"):
        load_weights(_fresh(d), tmp_path, ARCH, d["num_hidden_layers"])


def test_dummy_weights_are_deterministic_per_seed(tmp_path: Path) -> None:
    d = tiny_v4_dict()
    a, b, c = _fresh(d), _fresh(d), _fresh(d)
    load_weights(a, tmp_path, ARCH, 4, load_format="dummy", seed=3)
    load_weights(b, tmp_path, ARCH, 4, load_format="dummy", seed=3)
    load_weights(c, tmp_path, ARCH, 4, load_format="dummy", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attn.wq_a.weight"], sc["layers.0.attn.wq_a.weight"])
    tid = sa["layers.0.ffn.gate.tid2eid"]
    assert all(len(set(row)) == len(row) for row in tid.tolist())  # distinct experts per token
