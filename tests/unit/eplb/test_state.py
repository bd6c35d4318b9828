from __future__ import annotations

import pytest
import torch

from dsv4_serving.eplb.state import ExpertMap, LoadWindow


def test_route_spreads_a_replicated_expert_deterministically() -> None:
    m = ExpertMap([0, 1, 2, 1, 0, 1], num_logical=3)  # expert 1 has slots 1, 3, 5
    assert m.log_to_phys.tolist() == [[0, 4, -1], [1, 3, 5], [2, -1, -1]]
    idx = torch.tensor([[1, 2], [1, 0], [1, 1], [2, 0]])
    # replica = (token + choice) % count
    assert m.route(idx).tolist() == [[1, 2], [3, 0], [5, 1], [2, 0]]
    assert m.route(idx).tolist() == m.route(idx).tolist()


def test_every_logical_expert_needs_a_slot() -> None:
    with pytest.raises(ValueError, match=r"\[2\] have no physical slot"):
        ExpertMap([0, 1, 1], num_logical=3)


def test_window_counts_real_tokens_and_slides() -> None:
    w = LoadWindow(layers=2, slots=4, window=2)
    w.record(0, torch.tensor([[0, 1], [1, 3], [2, 2]]), real_tokens=2)  # 3rd row is a dummy
    w.record(1, torch.tensor([[3, 3]]), real_tokens=1)
    assert w.physical().tolist() == [[1, 2, 0, 1], [0, 0, 0, 2]]
    w.step()
    w.record(0, torch.tensor([[0, 0]]), real_tokens=1)
    w.step()  # the first step leaves the window
    assert w.physical().tolist() == [[2, 0, 0, 0], [0, 0, 0, 0]]
    w.record(0, torch.tensor([[1, 1]]), real_tokens=0)  # an idle rank's dummy batch
    w.step()
    assert w.physical().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]
    assert w.steps == 3


def test_logical_load_sums_replicas() -> None:
    w = LoadWindow(layers=1, slots=4, window=3)
    w.record(0, torch.tensor([[0, 1], [2, 3], [3, 3]]), real_tokens=3)
    p2l = torch.tensor([[0, 1, 1, 2]])
    assert w.logical(p2l, 3).tolist() == [[1, 2, 3]]
    with pytest.raises(ValueError, match="at least one step"):
        LoadWindow(1, 1, 0)


def test_remapping_a_layer_splits_its_history_over_the_new_replicas() -> None:
    w = LoadWindow(layers=2, slots=4, window=2)
    old = torch.tensor([0, 1, 2, 0])  # expert 0 in slots 0 and 3; 3 experts
    w.record(1, torch.tensor([[0, 3], [1, 2], [0, 0]]), real_tokens=3)  # e0: 4, e1: 1, e2: 1
    w.step()
    w.record(1, torch.tensor([[1, 1]]), real_tokens=1)  # e1: 2
    new = torch.tensor([1, 0, 1, 2])  # expert 1 now has the replicas
    w.remap(1, old, new, num_logical=3)
    assert w.ring[:, 0].sum() == 0  # the other layer is untouched
    assert w.logical(torch.stack([new, new]), 3)[1].tolist() == [4, 3, 1]  # totals kept
    # step 0: e1's 1 token -> the first replica; step 1: e1's 2 tokens -> one each
    assert w.ring[0, 1].tolist() == [1, 4, 0, 1]
    assert w.ring[1, 1].tolist() == [1, 0, 1, 0]
