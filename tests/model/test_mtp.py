"""The V4 MTP draft layer against an independent full-sequence computation: transformers has
no MTP, so the block runs as transformers' DeepseekV4DecoderLayer with the MTP weights and the
MTP glue (embedding/hidden projections, stream collapse, norm, head) is written out here."""

from __future__ import annotations

import pytest
import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.loader.names import to_transformers_state_dict
from dsv4_serving.models.reference import transformers_config_kwargs

from .v4_common import ARCH, build_ours, build_reference, tiny_v4_dict

transformers = pytest.importorskip("transformers")
BLOCK = 64


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def test_mtp_draft_logits_match_independent_full_sequence_computation() -> None:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    d = tiny_v4_dict()
    n_layers, hc, window = d["num_hidden_layers"], d["hc_mult"], d["sliding_window"]
    ours = build_ours(d, seed=11)
    ref = build_reference(d, ours)
    length = 60
    ids = torch.randint(0, d["vocab_size"], (length,), generator=torch.Generator().manual_seed(11))
    sd = ours.state_dict()

    # --- the independent computation ---
    kw = transformers_config_kwargs(d)
    kw["num_hidden_layers"] = n_layers + 1
    kw["compress_ratios"] = d["compress_ratios"][: n_layers + 1]
    hf_cfg = transformers.DeepseekV4Config(**kw)
    hf_cfg._attn_implementation = "eager"
    layer = DeepseekV4DecoderLayer(hf_cfg, n_layers).float().eval()
    glue = ("e_proj", "h_proj", "enorm", "hnorm", "norm.", "hc_head")
    block = {
        f"layers.{n_layers}." + k[len("mtp.0.") :]: v
        for k, v in sd.items()
        if k.startswith("mtp.0.") and not k[len("mtp.0.") :].startswith(glue)
    }
    prefix = f"model.layers.{n_layers}."
    hf_block = {k[len(prefix) :]: v for k, v in to_transformers_state_dict(block, ARCH).items()}
    missing, unexpected = layer.load_state_dict(hf_block, strict=False)
    assert not missing and not unexpected

    captured = {}
    hook = ref.model.layers[-1].register_forward_hook(
        lambda mod, args, out: captured.setdefault("streams", out)
    )
    with torch.no_grad():
        ref(ids[None])
        hook.remove()
        streams = captured["streams"][0, :-1]  # [L-1, hc, D]: main model output at p
        nxt = ids[1:]  # token at p + 1
        e = _rms(sd["embed.weight"][nxt], sd["mtp.0.enorm.weight"])
        h = _rms(streams, sd["mtp.0.hnorm.weight"])
        x = (e @ sd["mtp.0.e_proj.weight"].T)[:, None, :] + h @ sd["mtp.0.h_proj.weight"].T
        pos = torch.arange(length - 1)[None]
        pe = {
            t: ref.model.rotary_emb(x, position_ids=pos, layer_type=t) for t in ("main", "compress")
        }
        q, k = pos[0][:, None], pos[0][None, :]
        mask = torch.zeros(length - 1, length - 1).masked_fill(
            (k > q) | (k <= q - window), -torch.inf
        )
        out = layer(
            x[None],
            position_embeddings=pe,
            position_ids=pos,
            attention_mask=mask[None, None],
            input_ids=nxt[None],
        )[0]
        flat = _rms(out.flatten(1), None)
        pre = torch.sigmoid(
            flat @ sd["mtp.0.hc_head_fn"].T * sd["mtp.0.hc_head_scale"][0]
            + sd["mtp.0.hc_head_base"]
        ) + d.get("hc_eps", 1e-6)
        collapsed = (pre[..., None] * out).sum(1)
        want = _rms(collapsed, sd["mtp.0.norm.weight"]) @ sd["head.weight"].T
    assert out.shape[1] == hc

    # --- ours: main prefill, then the MTP layer in a chunk and token by token ---
    with torch.no_grad():
        cache = ours.allocate_cache(2, BLOCK, 1)
        main = ours(ids, AttentionMetadata.build([SeqChunk(0, length, [0], 0)], BLOCK), cache)
        got = torch.zeros_like(want)
        done = 0
        while done < length - 1:
            n = 25 if done == 0 else 1
            meta = AttentionMetadata.build([SeqChunk(done, n, [0], 0)], BLOCK)
            logits, _ = ours.mtp_forward(nxt[done : done + n], main[done : done + n], meta, cache)
            got[done : done + n] = logits
            done += n
    tol = 1e-4 * float(want.abs().max())
    assert (got - want).abs().max() <= tol
    assert want.argmax(-1).unique().numel() > 5
