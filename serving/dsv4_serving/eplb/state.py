"""The device-side half of EPLB: routing through replicas and counting expert load.

``ExpertMap`` turns the router's logical expert ids into physical slots. An expert with several
replicas spreads its tokens over them by ``(token position + choice) % replicas``: deterministic
(so every rank and every rerun routes alike) and even for a batch. ``LoadWindow`` counts tokens
per (layer, physical slot) for the last ``window`` steps; only real tokens count, while a dummy
batch still advances the window so every rank's step counter stays equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Recorder = Callable[[torch.Tensor], None]
"""Told each forward's physical slot choices [T, k] of one MoE layer."""


class ExpertMap:
    def __init__(
        self, phys_to_log: Sequence[int], num_logical: int, device: torch.device | str = "cpu"
    ) -> None:
        slots: list[list[int]] = [[] for _ in range(num_logical)]
        for s, e in enumerate(phys_to_log):
            slots[e].append(s)
        if any(not s for s in slots):
            missing = [e for e, s in enumerate(slots) if not s]
            raise ValueError(f"logical experts {missing} have no physical slot")
        width = max(len(s) for s in slots)
        table = torch.full((num_logical, width), -1, dtype=torch.long)
        for e, held in enumerate(slots):
            table[e, : len(held)] = torch.tensor(held)
        self.log_to_phys = table.to(device)
        self.count = torch.tensor([len(s) for s in slots], dtype=torch.long, device=device)
        self.phys_to_log = torch.tensor(list(phys_to_log), dtype=torch.long, device=device)

    @property
    def num_physical(self) -> int:
        return int(self.phys_to_log.numel())

    def route(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx`` [T, k] logical ids -> [T, k] physical slots."""
        t, k = idx.shape
        pos = torch.arange(t, device=idx.device)[:, None] + torch.arange(k, device=idx.device)
        replica = pos % self.count[idx]
        return self.log_to_phys[idx, replica]


class LoadWindow:
    def __init__(
        self, layers: int, slots: int, window: int, device: torch.device | str = "cpu"
    ) -> None:
        if window < 1:
            raise ValueError(f"EPLB window must be at least one step, got {window}")
        self.ring = torch.zeros(window, layers, slots, dtype=torch.long, device=device)
        self.pos = 0
        self.steps = 0

    def record(self, layer: int, phys: torch.Tensor, real_tokens: int) -> None:
        """Count the first ``real_tokens`` rows of ``phys`` [T, k] (the rest is padding or a
        dummy batch)."""
        if real_tokens <= 0:
            return
        flat = phys[:real_tokens].reshape(-1)
        self.ring[self.pos, layer] += torch.bincount(flat, minlength=self.ring.shape[2])

    def step(self) -> None:
        """End of an engine step (a dummy one too): the oldest step leaves the window."""
        self.steps += 1
        self.pos = (self.pos + 1) % self.ring.shape[0]
        self.ring[self.pos].zero_()

    def remap(self, layer: int, old: torch.Tensor, new: torch.Tensor, num_logical: int) -> None:
        """``layer``'s experts moved from placement ``old`` to ``new`` (``phys_to_log`` rows):
        its history becomes what the new slots would have counted, each step's logical load
        split evenly over the new replicas (the remainder to the first ones), totals kept."""
        rows = self.ring[:, layer]
        w = rows.shape[0]
        logical = torch.zeros(w, num_logical, dtype=rows.dtype, device=rows.device)
        logical.scatter_add_(1, old.to(rows.device).expand(w, -1), rows)
        new_l = new.tolist()
        seen: dict[int, int] = {}
        nth = []
        for e in new_l:
            nth.append(seen.get(e, 0))
            seen[e] = nth[-1] + 1
        dev = rows.device
        idx = torch.tensor(new_l, dtype=torch.long, device=dev)
        count = torch.tensor([seen[e] for e in new_l], dtype=rows.dtype, device=dev)
        replica = torch.tensor(nth, dtype=rows.dtype, device=dev)
        load = logical[:, idx]
        self.ring[:, layer] = load // count + (replica < load % count).to(rows.dtype)

    def physical(self) -> torch.Tensor:
        """[layers, slots] tokens over the window."""
        return self.ring.sum(dim=0)

    def logical(self, phys_to_log: torch.Tensor, num_logical: int) -> torch.Tensor:
        """[layers, experts]: each logical expert's load, summed over its replicas.
        ``phys_to_log`` is [layers, slots]."""
        load = self.physical()
        out = torch.zeros(load.shape[0], num_logical, dtype=load.dtype, device=load.device)
        return out.scatter_add_(1, phys_to_log, load)
