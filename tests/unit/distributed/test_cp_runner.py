"""Which steps a context-parallel rank runs split, and that an unsplit step is the model's own
forward (no collective: a size-1 group would fail on one)."""

from __future__ import annotations

import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.distributed.groups import Group
from dsv4_serving.engine.worker.cp_runner import CPForward, splits


def _meta(*chunks: tuple[int, int]) -> AttentionMetadata:
    return AttentionMetadata.build(
        [SeqChunk(c, n, list(range(8)), i) for i, (c, n) in enumerate(chunks)], 16
    )


def test_a_step_splits_when_one_chunk_has_2cp_blocks() -> None:
    assert splits(_meta((0, 64)), cp=2, align=16)  # 4 blocks = 2 x cp
    assert splits(_meta((0, 49)), cp=2, align=16)  # 4 blocks, the last partial
    assert not splits(_meta((0, 48)), cp=2, align=16)  # 3 blocks
    assert splits(_meta((10, 1), (0, 49)), cp=2, align=16)
    assert not splits(_meta((0, 64)), cp=4, align=16)
    assert not splits(_meta((100, 1), (7, 1)), cp=2, align=16)  # decodes: never


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = type("C", (), {"hc_mult": 2})()
        self.calls: list[object] = []

    def attention_backend(self, device: torch.device) -> None: ...

    def forward(
        self, ids: torch.Tensor, meta: object, cache: object, cp: object = None
    ) -> torch.Tensor:
        self.calls.append(cp)
        return ids.float()


def test_an_unsplit_step_is_the_model_forward() -> None:
    model = _Model()
    fwd = CPForward(model, Group((0, 1), 0), align=16)
    out = fwd(torch.arange(2), _meta((100, 1), (7, 1)), None)
    assert out.tolist() == [0.0, 1.0] and model.calls == [None] and fwd.split_steps == 0


def test_a_model_without_a_cp_forward_is_refused() -> None:
    class V3(torch.nn.Module):
        config = object()

    try:
        CPForward(V3(), Group((0, 1), 0), 16)
    except TypeError as exc:
        assert "V3 has no context-parallel forward" in str(exc)
    else:
        raise AssertionError("accepted")
