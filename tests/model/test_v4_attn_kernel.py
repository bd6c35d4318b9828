"""The V4 attention kernel (``kernels/v4_attn.cpp``) against the batched torch path it replaces
(``attention/v4.py``, the fallback and oracle): the same logits within float32 rounding
for prefill chunks (with and without context in the rings) beside decode tokens, across the
window and many CSA / HCA blocks; and a query row's result does not depend on the rest of the
batch. ``test_deepseek_v4.py`` checks the kernel path against transformers.

bfloat16 queries and / or key rows: the kernel's result is bit for bit its float32 result on the
same (widened) values, rounded once, in every build (AVX-512, AVX2 and scalar), the AVX-512
and AVX2 builds agree bit for bit (their head tiles and lane widths keep every sum's order); and a
bfloat16 model's logits through the kernel are no further from the float32 model's than the
torch path's in bfloat16 (which rounds the rotated queries and the output before its inverse
rotation)."""

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


def builds() -> list:  # type: ignore[type-arg]
    """The default build, the AVX2 one (on an AVX-512 machine) and the scalar one (a CPU
    without AVX2, and the vector loops' tails)."""
    if not available("v4_attn"):
        pytest.fail("the v4_attn kernel does not build here (g++ and ninja: make install)")
    exts = [build("v4_attn")]
    variants = ("avx2", "scalar") if exts[0].path == "avx512" else ("scalar",)
    return exts + [build("v4_attn", v) for v in variants if available("v4_attn", v)]


@pytest.mark.parametrize("d", [72, 128, 61])
def test_bf16_is_the_float32_kernel_rounded_once(d: int) -> None:
    g = torch.Generator().manual_seed(d)
    t, h, k, e, half = 9, 4, 12, 6, 8
    q = torch.randn(t, h, d, generator=g).bfloat16()
    ksrc, csrc = (
        torch.randn(30, d, generator=g).bfloat16(),
        torch.randn(20, d, generator=g).bfloat16(),
    )
    kidx = torch.randint(-1, 30, (t, k), generator=g)
    cidx = torch.randint(-1, 20, (t, e), generator=g)
    sink = torch.randn(h, generator=g)
    cos, sin = torch.randn(t, half, generator=g), torch.randn(t, half, generator=g)
    none = torch.empty(0)
    fma: list[torch.Tensor] = []
    for ext in builds():
        for c, s in ((none, none), (cos, sin)):
            want = ext.v4_attn(
                q.float(), ksrc.float(), kidx, csrc.float(), cidx, sink, d**-0.5, c, s
            )
            got = ext.v4_attn(q, ksrc, kidx, csrc, cidx, sink, d**-0.5, c, s)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16()), ext.path
            # float32 queries over a bfloat16 cache: the float32 result itself
            mixed = ext.v4_attn(q.float(), ksrc, kidx, csrc, cidx, sink, d**-0.5, c, s)
            assert mixed.dtype == torch.float32 and torch.equal(mixed, want), ext.path
            if ext.path != "scalar":  # head tiles and lane widths keep every sum's order
                fma.append(want)
            for inverse in (False, True):
                rot = ext.rope_tail(q, cos, sin, inverse)
                assert torch.equal(rot, ext.rope_tail(q.float(), cos, sin, inverse).bfloat16())
        with pytest.raises(RuntimeError, match="csrc has the wrong dtype"):
            ext.v4_attn(q, ksrc, kidx, csrc.float(), cidx, sink, d**-0.5, none, none)
    # two results per vector build (without, with rope): the AVX-512 build (4 heads a tile,
    # 16 lanes) and the AVX2 one (2 heads, 8 lanes) give the same bits
    for i in range(2, len(fma), 2):
        assert torch.equal(fma[0], fma[i]) and torch.equal(fma[1], fma[i + 1])


def test_bf16_model_is_nearer_float32_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    if not available("v4_attn"):
        pytest.fail("the v4_attn kernel does not build here (g++ and ninja: make install)")
    exact = run_mixed(build_ours(tiny_v4_dict(), seed=1))
    model = build_ours(tiny_v4_dict(), seed=1).to(torch.bfloat16)
    kernel = run_mixed(model)
    monkeypatch.setattr(v4a, "V4_ATTN", V4AttnKernel(use_kernel=False))
    torch_path = run_mixed(model)
    err_kernel = (kernel - exact).abs().mean()
    err_torch = (torch_path - exact).abs().mean()
    assert err_kernel <= err_torch, (err_kernel, err_torch)
    top = exact.argmax(-1)
    assert (kernel.argmax(-1) == top).float().mean() >= (
        torch_path.argmax(-1) == top
    ).float().mean()
