"""Paged MLA attention: the C++ kernel and the pure-torch fallback against a float64 reference,
for decode (1 query), MTP verification (k+1 queries) and a prefill chunk, float32 and bfloat16
latents, random block tables."""

from __future__ import annotations

import pytest
import torch

from dsv4_serving.kernels.build import available
from dsv4_serving.kernels.paged_mla import paged_mla_attention

pytestmark = pytest.mark.model
H, D, DV, BS = 4, 576, 512, 16


def case(queries: list[int], lens: list[int], dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // BS) for n in lens)
    n_blocks = sum(-(-n // BS) for n in lens) + 3
    pool = torch.randn(n_blocks, BS, D, generator=g).to(dtype)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    table = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        k = -(-n // BS)
        table[s, :k] = torch.tensor(perm[used : used + k])
        used += k
    qsl = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), H, D, generator=g) * 0.05
    return q, pool, table, qsl, torch.tensor(lens, dtype=torch.int32)


def reference(q, pool, table, qsl, lens, scale):  # type: ignore[no-untyped-def]
    out = torch.zeros(q.shape[0], H, DV, dtype=torch.float64)
    for s, n_keys in enumerate(lens.tolist()):
        a, b = int(qsl[s]), int(qsl[s + 1])
        lat = torch.cat([pool[int(blk)] for blk in table[s, : -(-n_keys // BS)]])[:n_keys].double()
        for j in range(b - a):
            visible = n_keys - (b - a) + j + 1
            sc = (q[a + j].double() @ lat[:visible].T) * scale
            out[a + j] = sc.softmax(-1) @ lat[:visible, :DV]
    return out


SHAPES = {
    "decode": ([1, 1, 1, 1, 1], [1, 17, 40, 64, 333]),
    "mtp-verify": ([4, 4, 4], [4, 30, 129]),
    "chunk": ([37, 1], [37, 100]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "fallback"])
def test_matches_reference(shape: str, dtype: torch.dtype, use_kernel: bool) -> None:
    if use_kernel and not available("paged_mla"):
        pytest.fail(
            "the paged MLA kernel does not build on this machine (g++ and ninja are installed by make install)"
        )
    queries, lens = SHAPES[shape]
    q, pool, table, qsl, sl = case(queries, lens, dtype)
    scale = D**-0.5
    got = paged_mla_attention(q, pool, table, qsl, sl, scale, DV, use_kernel=use_kernel)
    want = reference(q, pool, table, qsl, sl, scale)
    assert got.shape == (q.shape[0], H, DV)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_a_sequence_does_not_depend_on_its_batch() -> None:
    if not available("paged_mla"):
        pytest.fail("the paged MLA kernel does not build on this machine")
    q, pool, table, qsl, sl = case([1, 1, 1], [50, 70, 90], torch.float32)
    whole = paged_mla_attention(q, pool, table, qsl, sl, 0.04, DV, use_kernel=True)
    alone = paged_mla_attention(
        q[1:2],
        pool,
        table[1:2],
        torch.tensor([0, 1], dtype=torch.int32),
        sl[1:2],
        0.04,
        DV,
        use_kernel=True,
    )
    assert torch.equal(whole[1:2], alone)
