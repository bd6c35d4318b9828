"""The V4 attention kernel (``kernels/v4_attn.cpp``) against the batched torch path it replaces
(``attention/v4.py``, the fallback and oracle): the same logits within float32 rounding
for prefill chunks (with and without context in the rings) beside decode tokens, across the
window and many CSA / HCA blocks; and a query row's result does not depend on the rest of the
batch. ``test_deepseek_v4.py`` checks the kernel path against transformers."""

from __future__ import annotations

import pytest
import torch

import dsv4_serving.attention.v4 as v4a
from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.kernels.build import available, build
from dsv4_serving.kernels.v4_attn import V4AttnKernel
from dsv4_serving.layers.rope import rotate_tail_interleaved

from .v4_common import build_ours, tiny_v4_dict

pytestmark = pytest.mark.model
VOCAB, BLOCK = 320, 64


def run_mixed(model: torch.nn.Module) -> torch.Tensor:
    """Three sequences share each step: one prefilled then decoded token by token, one fed
    in chunks of 7, one with a long first chunk then chunks of 3; logits of every token."""
    length = 90
    ids = torch.randint(0, VOCAB, (3, length), generator=torch.Generator().manual_seed(1))
    cache = model.allocate_cache(16, BLOCK, 4)  # type: ignore[operator]
    blocks = {0: [5, 1], 1: [2, 7], 2: [4, 0]}
    slots = {0: 2, 1: 0, 2: 3}
    first, later = {0: 20, 1: 7, 2: 37}, {0: 1, 1: 7, 2: 3}
    done = dict.fromkeys(range(3), 0)
    got = torch.zeros(3, length, VOCAB)
    with torch.no_grad():
        while any(v < length for v in done.values()):
            chunks, toks, who = [], [], []
            for i in range(3):
                if done[i] >= length:
                    continue
                n = min(first[i] if done[i] == 0 else later[i], length - done[i])
                chunks.append(SeqChunk(done[i], n, blocks[i], slots[i]))
                toks.append(ids[i, done[i] : done[i] + n])
                who.append((i, done[i], n))
            meta = AttentionMetadata.build(chunks, BLOCK)
            lo = model.compute_logits(model(torch.cat(toks), meta, cache))  # type: ignore[operator]
            for (i, c, n), start in zip(who, meta.query_start_loc, strict=False):
                got[i, c : c + n] = lo[start : start + n]
                done[i] += n
    return got


def test_kernel_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not available("v4_attn"):
        pytest.fail("the v4_attn kernel does not build here (g++ and ninja: make install)")
    model = build_ours(tiny_v4_dict(), seed=1)
    kernel = run_mixed(model)
    monkeypatch.setattr(v4a, "V4_ATTN", V4AttnKernel(use_kernel=False))
    torch_path = run_mixed(model)
    assert (kernel - torch_path).abs().max() <= 1e-5 * float(torch_path.abs().max())


def test_a_row_does_not_depend_on_its_batch() -> None:
    if not available("v4_attn"):
        pytest.fail("the v4_attn kernel does not build here (g++ and ninja: make install)")
    ext = build("v4_attn")
    g = torch.Generator().manual_seed(0)
    t, h, d, k, e, half = 9, 4, 72, 12, 6, 8
    q = torch.randn(t, h, d, generator=g)
    ksrc, csrc = torch.randn(30, d, generator=g), torch.randn(20, d, generator=g)
    kidx = torch.randint(-1, 30, (t, k), generator=g)
    cidx = torch.randint(-1, 20, (t, e), generator=g)
    sink = torch.randn(h, generator=g)
    cos, sin = torch.randn(t, half, generator=g), torch.randn(t, half, generator=g)
    none = torch.empty(0)
    for c, s in ((none, none), (cos, sin)):
        out = ext.v4_attn(q, ksrc, kidx, csrc, cidx, sink, d**-0.5, c, s)
        for i in (0, 4, 8):
            one = slice(i, i + 1)
            cs = (c[one], s[one]) if c.numel() else (c, s)
            alone = ext.v4_attn(q[one], ksrc, kidx[one], csrc, cidx[one], sink, d**-0.5, *cs)
            assert torch.equal(alone[0], out[i])
        # against the definition: softmax over the row's keys and the sink, times the keys;
        # with cos / sin the query is rotated first and the output rotated back
        qr = rotate_tail_interleaved(q, cos, sin) if c.numel() else q
        want = torch.empty_like(q)
        for i in range(t):
            rows = [ksrc[j] for j in kidx[i] if j >= 0] + [csrc[j] for j in cidx[i] if j >= 0]
            keys = torch.stack(rows).double()
            logits = torch.einsum("hd,kd->hk", qr[i].double(), keys) * d**-0.5
            probs = torch.cat((logits, sink.double()[:, None]), dim=1).softmax(dim=1)[:, :-1]
            want[i] = (probs @ keys).float()
        if c.numel():
            want = rotate_tail_interleaved(want, cos, sin, inverse=True)
        assert torch.allclose(out, want, atol=1e-4)


def test_rope_matches_the_torch_rotation() -> None:
    if not available("v4_attn"):
        pytest.fail("the v4_attn kernel does not build here (g++ and ninja: make install)")
    ext = build("v4_attn")
    g = torch.Generator().manual_seed(0)
    for shape in ((7, 48), (7, 3, 48), (7, 2, 3, 32)):
        x = torch.randn(*shape, generator=g)
        cos, sin = torch.randn(7, 16, generator=g), torch.randn(7, 16, generator=g)
        for inverse in (False, True):
            want = rotate_tail_interleaved(x, cos, sin, inverse)
            got = ext.rope_tail(x, cos, sin, inverse)
            assert torch.allclose(got, want, atol=1e-6)
            assert torch.equal(got[..., :-32], x[..., :-32])
