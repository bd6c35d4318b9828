"""EPLB on one MoE layer across EP ranks (gloo): the imbalance a skewed routing causes, what a
re-placement costs, and the step time and tokens/s before and after.

Each rank holds its share of the physical expert slots (every logical expert's weights come
from its own seed, so a replica is the same tensor wherever it lives). Each step every rank
routes its own tokens (a Zipf-skewed top-k over the logical experts, the hot ones numbered
first so the identity placement puts them all on rank 0), all-gathers the tokens and routes,
computes the tokens routed to its slots and all-reduces the output (the AllGather MoE comm of
``layers/moe_comm.py``). The step ends when the slowest rank is done, so the straggler sets the
step time. After the "off" phase the ranks sum their load window, rank 0 plans
(``eplb.algorithm.rebalance``) and broadcasts, the weights move (``eplb.transfer``), and the
"on" phase runs the same workload through the new ``ExpertMap``. A fixed probe batch is
computed before and after: the outputs must not change.

    .venv/bin/python benchmarks/eplb.py [--worlds 2,4] [--steps 30] [--tokens 256]
        [--experts 16] [--redundant 4] [--dim 256] [--inter 512] [--zipf 1.2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any


def expert_weights(e: int, dim: int, inter: int) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + e)
    s = dim**-0.5
    return (
        torch.randn(inter, dim, generator=g) * s,
        torch.randn(inter, dim, generator=g) * s,
        torch.randn(dim, inter, generator=g) * inter**-0.5,
    )


class RankBench:
    """One EP rank's MoE layer: its expert stacks, its batches, one step, one phase of steps."""

    def __init__(self, rank: int, world: int, args: argparse.Namespace) -> None:
        import torch

        self.rank, self.world, self.args = rank, world, args
        self.E, self.T, self.K, self.D, self.inter = (
            args.experts,
            args.tokens,
            2,
            args.dim,
            args.inter,
        )
        self.probs = torch.tensor([1.0 / (e + 1) ** args.zipf for e in range(self.E)])
        self.gen = torch.Generator().manual_seed(rank + 1)

    def stacks(self, phys: list[int]) -> list[Any]:
        import torch

        per = len(phys) // self.world
        mine = [
            expert_weights(e, self.D, self.inter)
            for e in phys[self.rank * per : (self.rank + 1) * per]
        ]
        return [torch.stack([w[i] for w in mine]) for i in range(3)]

    def batch(self, g: Any) -> tuple[Any, Any, Any]:
        import torch

        T, E, K = self.T, self.E, self.K
        x = torch.randn(T, self.D, generator=g)
        idx = torch.multinomial(self.probs.expand(T, E), K, generator=g)
        w = torch.softmax(torch.randn(T, K, generator=g), -1)
        return x, idx, w

    def step(
        self, xs: tuple[Any, Any, Any], emap: Any, w: list[Any], window: Any | None
    ) -> tuple[Any, int]:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        rank, T = self.rank, self.T
        x, idx, wt = xs
        all_x = [torch.empty_like(x) for _ in range(self.world)]
        all_i = [torch.empty_like(idx) for _ in range(self.world)]
        all_w = [torch.empty_like(wt) for _ in range(self.world)]
        dist.all_gather(all_x, x)
        dist.all_gather(all_i, idx)
        dist.all_gather(all_w, wt)
        X, IDX, WT = torch.cat(all_x), torch.cat(all_i), torch.cat(all_w)
        phys = emap.route(IDX)
        if window is not None:
            window.record(0, phys[rank * T : (rank + 1) * T], T)
        per = w[0].shape[0]
        y = torch.zeros_like(X)
        computed = 0
        for j in range(per):
            rows, choice = (phys == rank * per + j).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            computed += rows.numel()
            h = F.silu(X[rows] @ w[0][j].T) * (X[rows] @ w[1][j].T)
            y.index_add_(0, rows, (h @ w[2][j].T) * WT[rows, choice, None])
        dist.all_reduce(y)
        return y[rank * T : (rank + 1) * T], computed

    def phase(self, emap: Any, w: list[Any], window: Any | None) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        from dsv4_serving.eplb.algorithm import imbalance

        times, computed = [], []
        for _ in range(self.args.steps):
            xs = self.batch(self.gen)
            dist.barrier()
            t0 = time.perf_counter()
            _, c = self.step(xs, emap, w, window)
            dist.barrier()  # the step is over when the slowest rank is
            times.append(time.perf_counter() - t0)
            computed.append(c)
            if window is not None:
                window.step()
        per_rank = torch.tensor([float(sum(computed))])
        gathered = [torch.zeros(1) for _ in range(self.world)]
        dist.all_gather(gathered, per_rank)
        rank_tokens = [float(g) for g in gathered]
        return {
            "step_ms_median": statistics.median(times[2:] or times) * 1e3,
            "rank_tokens": rank_tokens,
            "imbalance": imbalance(rank_tokens),
        }


def replace_experts(
    bench: RankBench, emap: Any, load: Any, w: list[Any]
) -> tuple[Any, list[Any], list[int]]:
    """Rank 0 plans from the agreed load, every rank moves weights: the new map, stacks and
    placement."""
    import torch.distributed as dist

    from dsv4_serving.eplb.algorithm import rebalance
    from dsv4_serving.eplb.state import ExpertMap
    from dsv4_serving.eplb.transfer import apply_moves, plan_moves

    E, world, rank = bench.E, bench.world, bench.rank
    plan = [None]
    if rank == 0:
        plan = [rebalance(load.tolist(), E + bench.args.redundant, 1, 1, world).phys_to_log[0]]
    dist.broadcast_object_list(plan, src=0)
    new = list(plan[0])  # type: ignore[arg-type]
    moves = plan_moves(emap.phys_to_log.tolist(), new, world)
    w = apply_moves(w, moves, rank, list(range(world)), new_per_rank=len(new) // world)
    return ExpertMap(new, E), w, new


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from dsv4_serving.eplb.state import ExpertMap, LoadWindow

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    bench = RankBench(rank, world, args)
    identity = list(range(bench.E))
    w = bench.stacks(identity)
    emap = ExpertMap(identity, bench.E)
    window = LoadWindow(1, bench.E, args.steps)
    probe = bench.batch(torch.Generator().manual_seed(99 + rank))
    before_probe, _ = bench.step(probe, emap, w, None)
    off = bench.phase(emap, w, window)

    # re-placement: agree on the load, rank 0 plans, everyone moves weights
    load = window.logical(emap.phys_to_log[None, :], bench.E).float()
    dist.all_reduce(load)
    dist.barrier()
    t0 = time.perf_counter()
    emap, w, new = replace_experts(bench, emap, load, w)
    dist.barrier()
    replace_ms = (time.perf_counter() - t0) * 1e3
    after_probe, _ = bench.step(probe, emap, w, None)
    on = bench.phase(emap, w, None)
    out.put(
        {
            "rank": rank,
            "off": off,
            "on": on,
            "replace_ms": replace_ms,
            "probe_max_diff": float((after_probe - before_probe).abs().max()),
            "placement": new,
        }
    )
    dist.destroy_process_group()


def run(world: int, args: argparse.Namespace) -> dict[str, Any]:
    from dsv4_common.process import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in range(world)]
    for p in procs:
        p.join(30)
    r0 = min(results, key=lambda r: r["rank"])
    tokens = world * args.tokens
    return {
        "world": world,
        "imbalance_off": round(r0["off"]["imbalance"], 3),
        "imbalance_on": round(r0["on"]["imbalance"], 3),
        "step_ms_off": round(r0["off"]["step_ms_median"], 2),
        "step_ms_on": round(r0["on"]["step_ms_median"], 2),
        "tok_s_off": round(tokens / r0["off"]["step_ms_median"] * 1e3, 1),
        "tok_s_on": round(tokens / r0["on"]["step_ms_median"] * 1e3, 1),
        "replace_ms": round(max(r["replace_ms"] for r in results), 2),
        "probe_max_diff": max(r["probe_max_diff"] for r in results),
        "placement": r0["placement"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--redundant", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--zipf", type=float, default=1.2)
    args = ap.parse_args()
    for world in (int(w) for w in args.worlds.split(",")):
        print(json.dumps(run(world, args)), flush=True)


if __name__ == "__main__":
    main()
