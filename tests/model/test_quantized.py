"""Checkpoints in each quantized format, served quantized, against the same checkpoint
dequantized at load (``--quantization none``, the oracle).

Tolerances: fp8 and fp4 compute the same products as the oracle (chunks of rows dequantized
before the matmul): logits within 1e-4 of the logit scale. W8A8 also rounds activations to
int8 per token (~0.7% per matmul, compounding over layers and flipping close expert choices):
logits within 15% relative L2, and a greedy token may differ from the oracle's only where the
oracle's top-2 margin is below 0.25; the tests print how often that happens.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.worker.model_loader import LoadedModel, load_model
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.models.registry import REGISTRY
from dsv4_serving.presets.configs import preset_config

from .quant_checkpoint import write_checkpoint

pytestmark = pytest.mark.model

CASES = [(p, f) for p in ("dsv4-tiny", "dsv3-small") for f in ("fp8", "fp4", "w8a8")]
W8A8_REL_L2 = 0.15
W8A8_MARGIN = 0.25
# stored bytes per parameter of the quantized weights, scales included (tiny shapes: a scale
# per 64-128 inputs weighs more than on real ones)
BYTES_PER_PARAM = {"fp8": (1.0, 1.02), "w8a8": (1.0, 1.07), "fp4": (0.5, 0.54)}


def _source(preset: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg = preset_config(preset)
    cls = REGISTRY.resolve(cfg["architectures"][0])
    model = cls(cls.config_class.from_dict(cfg))
    init_dummy_weights(model, seed=3)
    return cfg, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    out = {}
    for preset in ("dsv4-tiny", "dsv3-small"):
        cfg, state = _source(preset)
        for fmt in ("fp8", "fp4", "w8a8"):
            root = tmp_path_factory.mktemp(f"{preset}-{fmt}")
            out[(preset, fmt)] = write_checkpoint(root, cfg, state, fmt)
    return out


def _logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    m, bs = lm.model, lm.block_size
    nb = -(-len(ids) // bs) + 1
    cache = m.allocate_cache(nb, bs, 1)
    meta = AttentionMetadata.build([SeqChunk(0, len(ids), list(range(nb)), 0)], bs)
    with torch.inference_mode():
        return m.compute_logits(m.forward(torch.tensor(ids), meta, cache)).float()


def _quantized_weight_bytes(lm: LoadedModel, experts_only: bool = False) -> tuple[int, int]:
    """(stored bytes of the quantized weights and their scales, their parameter count)."""
    stored = params = 0
    for prefix, module in lm.model.named_modules():
        if experts_only and not prefix.endswith("ffn.experts"):
            continue
        for name in getattr(module, "quant_params", ()):
            t = module.get_parameter(name)
            stored += t.numel() * t.element_size()
            if not name.endswith("_scale"):
                params += t.numel() * (2 if t.dtype == torch.uint8 else 1)
    return stored, params


@pytest.mark.parametrize(("preset", "fmt"), CASES)
def test_quantized_logits_match_the_dequantized_oracle(
    checkpoints: dict[tuple[str, str], Path], preset: str, fmt: str
) -> None:
    ckpt = str(checkpoints[(preset, fmt)])
    q = load_model(EngineConfig(model=ckpt))
    oracle = load_model(EngineConfig(model=ckpt, quantization="none"))
    assert q.model_config.quant.name == fmt and oracle.model_config.quant.name == "none"
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    got, want = _logits(q, ids), _logits(oracle, ids)
    if fmt == "w8a8":
        rel = float((got - want).norm() / want.norm())
        top2 = want.topk(2, dim=-1).values
        differ = got.argmax(-1) != want.argmax(-1)
        margins = (top2[:, 0] - top2[:, 1])[differ]
        print(
            f"{preset} w8a8: rel L2 {rel:.3f}, argmax differs at {int(differ.sum())}/40 "
            f"positions, oracle margins there {margins.tolist()}"
        )
        assert rel < W8A8_REL_L2
        assert bool((margins < W8A8_MARGIN).all())
    else:
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    # fp4: the routed experts (the fp8 linears beside them hold 1 B/param)
    stored, params = _quantized_weight_bytes(q, experts_only=fmt == "fp4")
    lo, hi = BYTES_PER_PARAM[fmt]
    assert lo <= stored / params <= hi
    total_q = sum(p.numel() * p.element_size() for p in q.model.parameters())
    total_o = sum(p.numel() * p.element_size() for p in oracle.model.parameters())
    print(
        f"{preset} {fmt}: {stored / params:.3f} B/param quantized, model {total_q} B vs "
        f"{total_o} B float32"
    )
    assert total_q < 0.6 * total_o


def _work() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23, 60)]


def _greedy(config: EngineConfig, prompts: list[list[int]], steps: int) -> list[list[int]]:
    from dsv4_serving.engine.request import EngineCoreRequest
    from dsv4_serving.engine.sample.sampling_params import SamplingParams

    core = EngineCore(config)
    out: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        core.add_request(EngineCoreRequest(str(i), p, sp))
    while core.has_unfinished_requests():
        for o in core.step():
            out[int(o.request_id)].extend(o.new_token_ids)
    return out


@pytest.mark.parametrize(("preset", "fmt"), CASES)
def test_greedy_tokens_of_a_quantized_engine_are_the_dequantized_engines(
    checkpoints: dict[tuple[str, str], Path], preset: str, fmt: str
) -> None:
    ckpt = str(checkpoints[(preset, fmt)])
    base = EngineConfig(model=ckpt, max_model_len=256, num_kv_blocks=64, max_num_seqs=4)
    prompts, steps = _work(), 8
    got = _greedy(base, prompts, steps)
    want = _greedy(replace(base, quantization="none"), prompts, steps)
    if fmt != "w8a8":
        assert got == want
        return
    oracle = load_model(replace(base, quantization="none"))
    diverged = 0
    for p, g, w in zip(prompts, got, want, strict=True):
        k = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        if k is None:
            continue
        diverged += 1
        top2 = _logits(oracle, p + w[:k])[-1].topk(2).values
        assert float(top2[0] - top2[1]) < W8A8_MARGIN, (p, g, w)
    print(f"{preset} w8a8: {diverged}/{len(prompts)} sequences diverge within {steps} tokens")
