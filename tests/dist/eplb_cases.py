"""EPLB weight moves on gloo ranks: weights coded by (layer, logical expert)."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist

from dsv4_serving.eplb.algorithm import rebalance
from dsv4_serving.eplb.transfer import apply_moves, plan_moves

LAYERS, EXPERTS = 3, 8


def coded(layer: int, expert: int, shape: tuple[int, ...]) -> torch.Tensor:
    return (
        layer * 1000.0
        + expert * 10.0
        + torch.arange(float(torch.tensor(shape).prod())).view(shape) / 1e3
    )


def random_moves(rank: int, world: int, port: int, slots: int, rounds: int) -> list[dict[str, Any]]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        rng = random.Random(11)  # the same plans on every rank
        per = slots // world
        place = [
            [e for e in range(EXPERTS)] + [rng.randrange(EXPERTS) for _ in range(slots - EXPERTS)]
            for _ in range(LAYERS)
        ]
        w1 = {
            layer: torch.stack(
                [coded(layer, place[layer][s], (3, 4)) for s in range(rank * per, (rank + 1) * per)]
            )
            for layer in range(LAYERS)
        }
        w2 = {
            layer: torch.stack(
                [coded(layer, place[layer][s], (4, 2)) for s in range(rank * per, (rank + 1) * per)]
            )
            for layer in range(LAYERS)
        }
        report = []
        for _ in range(rounds):
            load = [[rng.paretovariate(1.2) for _ in range(EXPERTS)] for _ in range(LAYERS)]
            new = rebalance(load, slots, groups=1, nodes=1, ranks=world).phys_to_log
            moved = 0
            for layer in range(LAYERS):
                moves = plan_moves(place[layer], new[layer], world)
                moved += sum(m.src_slot // per != m.dst_slot // per for m in moves)
                w1[layer], w2[layer] = apply_moves(
                    [w1[layer], w2[layer]], moves, rank, list(range(world))
                )
                place[layer] = list(new[layer])
            wrong = [
                (layer, s)
                for layer in range(LAYERS)
                for i, s in enumerate(range(rank * per, (rank + 1) * per))
                if not torch.equal(w1[layer][i], coded(layer, place[layer][s], (3, 4)))
                or not torch.equal(w2[layer][i], coded(layer, place[layer][s], (4, 2)))
            ]
            report.append({"wrong": wrong, "remote_moves": moved})
        return report
    finally:
        dist.destroy_process_group()
