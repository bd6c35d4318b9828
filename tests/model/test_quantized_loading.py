"""Loading a quantized checkpoint: a TP or EP rank holds exactly its slice of the
single-process quantized tensors (scales included), an EP rank never opens another rank's
experts, and loading never holds a float copy of the model (peak memory while loading below
1.5x the final resident bytes, measured in a fresh process)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_serving.distributed.groups import Group, ModelParallel
from dsv4_serving.layers.quant.scheme import QuantScheme
from dsv4_serving.layers.shard import shard_specs
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.loader.weights import load_weights
from dsv4_serving.models.config import DeepseekV4Config
from dsv4_serving.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsv4_serving.presets.configs import preset_config, shape_config

from .quant_checkpoint import write_checkpoint

pytestmark = pytest.mark.model

ARCH = "DeepseekV4ForCausalLM"
BLOCK = (32, 32)  # dsv4-tiny's TP-2 slices are multiples of 32, not of 128


def _model(parallel: ModelParallel, fmt: str) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config.from_dict(preset_config("dsv4-tiny"))
    return DeepseekV4ForCausalLM(
        dataclasses.replace(cfg, quant=QuantScheme.of(fmt, BLOCK)), parallel
    )  # type: ignore[arg-type]


def _pair(rank: int) -> Group:
    return Group((0, 1), rank)


@pytest.fixture(scope="module")
def source() -> dict[str, torch.Tensor]:
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(preset_config("dsv4-tiny")))
    init_dummy_weights(model, seed=5)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fmt", ["fp4", "w8a8"])
@pytest.mark.parametrize("layout", ["tp", "tp+ep"])
def test_a_rank_holds_its_slice_of_the_quantized_tensors(
    tmp_path: Path, source: dict[str, torch.Tensor], fmt: str, layout: str
) -> None:
    cfg = preset_config("dsv4-tiny")
    ckpt = write_checkpoint(tmp_path, cfg, source, fmt, block=BLOCK)
    full = _model(ModelParallel(), fmt)
    load_weights(full, ckpt, ARCH, 4)
    if layout == "tp+ep":  # experts 0-3 are rank 0's: point their file at nothing
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        for name in index["weight_map"]:
            if ".ffn.experts." in name and int(name.split(".ffn.experts.")[1].split(".")[0]) < 4:
                index["weight_map"][name] = "absent.safetensors"
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    ep = _pair(1) if layout == "tp+ep" else Group((0,), 0)
    part = _model(ModelParallel(tp=_pair(1), ep=ep), fmt)
    load_weights(part, ckpt, ARCH, 4)
    specs = shard_specs(part)
    assert "layers.0.attn.wq_b.weight_scale" in specs or fmt == "w8a8"
    whole = dict(full.named_parameters())
    for name, p in part.named_parameters():
        spec = specs.get(name)
        want = whole[name] if spec is None else spec.narrow(whole[name])
        assert torch.equal(
            p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
            want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want,
        ), name


_PEAK = r"""
import json, sys, threading, time
import torch
from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.worker.model_loader import load_model

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
peak = [0]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)
# warm-up: the lazily imported modules and allocator arenas are not the model's
del load_model(EngineConfig(model="dsv3-small", kv_cache_memory_gb=0.01)).model
import ctypes, gc
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
base = anon()
t = threading.Thread(target=sample); t.start()
lm = load_model(EngineConfig(model=sys.argv[1], kv_cache_memory_gb=0.01))
done.set(); t.join()
peak[0] = max(peak[0], anon())
resident = sum(p.numel() * p.element_size() for p in lm.model.parameters())
print(json.dumps({"peak": peak[0] - base, "resident": resident,
                  "scheme": lm.model_config.quant.name}))
"""


@pytest.mark.parametrize("fmt", ["fp8", "w8a8"])
def test_loading_holds_no_float_copy_of_the_model(tmp_path: Path, fmt: str) -> None:
    cfg = shape_config("dsv3-anchor") | {"intermediate_size": 2048, "torch_dtype": "float32"}
    from dsv4_serving.models.registry import REGISTRY

    cls = REGISTRY.resolve(cfg["architectures"][0])
    model = cls(cls.config_class.from_dict(cfg))
    init_dummy_weights(model, seed=1)
    ckpt = write_checkpoint(tmp_path / fmt, cfg, model.state_dict(), fmt, shards=4)
    del model
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(ckpt)],
        capture_output=True,
        text=True,
        timeout=300,
        # a fixed threshold: tensors are mmapped and given back when freed, so resident
        # anonymous memory is what is alive (glibc would otherwise keep freed heap)
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"{fmt}: resident {m['resident'] / 2**20:.1f} MiB, peak while loading "
        f"{m['peak'] / 2**20:.1f} MiB ({m['peak'] / m['resident']:.2f}x)"
    )
    assert m["scheme"] == fmt
    assert m["peak"] < 1.5 * m["resident"]


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "w8a8"])
def test_dummy_quantized_weights_of_a_shard_are_the_single_process_values_sliced(
    fmt: str,
) -> None:
    full = _model(ModelParallel(), fmt)
    init_dummy_weights(full, seed=2)
    part = _model(ModelParallel(tp=_pair(0), ep=_pair(0) if fmt == "w8a8" else Group((0,), 0)), fmt)
    init_dummy_weights(part, seed=2)
    specs, whole = shard_specs(part), dict(full.named_parameters())
    for name, p in part.named_parameters():
        want = whole[name] if name not in specs else specs[name].narrow(whole[name])
        assert torch.equal(
            p.view(torch.uint8) if p.element_size() == 1 else p,
            want.view(torch.uint8) if want.element_size() == 1 else want,
        ), name


def _hf_name(native: str) -> str:
    """Our native checkpoint name -> transformers' (ModelSlim writes these), scales included."""
    import re

    from dsv4_serving.loader.names import to_transformers_state_dict

    m = re.match(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(.+)$", native)
    if m:
        part = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[m.group(3)]
        return f"model.layers.{m.group(1)}.mlp.experts.{m.group(2)}.{part}.{m.group(4)}"
    arch = "DeepseekV3ForCausalLM"
    return next(iter(to_transformers_state_dict({native: torch.zeros(1)}, arch)))


def test_modelslim_w8a8_in_transformers_names_loads_as_the_native_one(tmp_path: Path) -> None:
    """ModelSlim's layout: transformers' names, per-expert tensors, ``weight_scale`` [O, 1]
    and ``weight_offset`` beside each int8 weight, the description file beside the shards."""
    from safetensors.torch import save_file

    from dsv4_serving.engine.config import EngineConfig
    from dsv4_serving.engine.worker.model_loader import load_model
    from dsv4_serving.models.config import DeepseekV3Config
    from dsv4_serving.models.deepseek_v3 import DeepseekV3ForCausalLM

    from .quant_checkpoint import quantized_checkpoint

    cfg = preset_config("dsv3-small") | {"num_nextn_predict_layers": 0}
    src = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(cfg))
    init_dummy_weights(src, seed=7)
    native = write_checkpoint(tmp_path / "native", cfg, src.state_dict(), "w8a8")
    tensors, extra = quantized_checkpoint(src.state_dict(), "w8a8", v4=False)
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({_hf_name(n): t for n, t in tensors.items()}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(cfg))
    desc = {
        _hf_name(k) if k != "model_quant_type" else k: v
        for k, v in extra["__description__"].items()
    }
    (hf / "quant_model_description.json").write_text(json.dumps(desc))
    a = load_model(EngineConfig(model=str(native))).model.state_dict()
    b = load_model(EngineConfig(model=str(hf))).model.state_dict()
    assert a.keys() == b.keys() and a["layers.1.ffn.experts.w1"].dtype == torch.int8
    assert all(torch.equal(a[k], b[k]) for k in a)
