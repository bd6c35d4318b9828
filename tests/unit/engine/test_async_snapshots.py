"""Async scheduling snapshots the block boundaries a decode passes exactly as the synchronous
engine does: the step that starts at a boundary is scheduled before the boundary's last
token (and, with MTP, the token after it) is sampled, so a snapshot slot is reserved then,
the step thread copies the state into it if the step does start there, and the boundary is
published when its tokens are known. Same cached blocks, same snapshot keys, same states."""

from __future__ import annotations

import pytest

from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.sched.async_scheduler import AsyncScheduler
from dsv4_serving.engine.core.sched.scheduler import Scheduler, SchedulerConfig

from .test_async_scheduler import add
from .test_async_scheduler import drive as drive_async
from .test_scheduler import BS, FakeRunner, alone, prompts
from .test_scheduler import drive as drive_sync


class StateRunner(FakeRunner):
    """The fake model with a state slot per request: the tokens it has consumed. Copies and
    in-chunk snapshots move those, as the model's state slots are moved."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.slots: dict[int, tuple[int, ...]] = {}

    def execute(self, out):  # type: ignore[no-untyped-def]
        for src, dst in out.state_copies:
            self.slots[dst] = self.slots.get(src, ())
        res = super().execute(out)
        for s in out.scheduled:
            h = self.hist[s.request_id]
            for b, slot in s.snapshots:
                self.slots[slot] = tuple(h[:b])
            self.slots[s.state_slot] = tuple(h)
        return res


def run(cls: type[Scheduler], k: int, ps: list[list[int]], n: int, stops: bool):  # type: ignore[no-untyped-def]
    kv = KVCacheManager(
        400, BS, 4, True, has_state=True, num_snapshot_slots=200, key_next_token=k > 0
    )
    sched = cls(SchedulerConfig(4, 16, 256, True, k), kv)
    want = {f"r{i}": alone(p, n) for i, p in enumerate(ps)}
    for i, p in enumerate(ps):
        w = want[f"r{i}"]
        stop = w[5 + 3 * i] if stops else None  # found when sampled: a step is in flight
        add(sched, f"r{i}", p, n, stop)  # type: ignore[arg-type]
        want[f"r{i}"] = w[: w.index(stop) + 1] if stop is not None else w
    runner = StateRunner(k)
    if cls is AsyncScheduler:
        assert drive_async(sched, runner) == want  # type: ignore[arg-type]
    else:
        assert drive_sync(sched, runner) == want
    snaps = {key: runner.slots[slot] for key, slot in kv._boundaries.items()}  # type: ignore[index]
    return snaps, set(kv.pool._cached), sched


@pytest.mark.parametrize("stops", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_async_decodes_snapshot_the_boundaries_they_pass_as_sync_does(k: int, stops: bool) -> None:
    ps = prompts(6)
    want, want_blocks, _ = run(Scheduler, k, ps, 23, stops)
    got, blocks, sched = run(AsyncScheduler, k, ps, 23, stops)
    assert got == want and blocks == want_blocks
    # decodes passed boundaries: more snapshots than the prompts' boundaries
    assert len(got) > sum(len(p) // BS for p in ps)
    for state in got.values():  # each is the state at its boundary
        assert state and len(state) % BS == 0
    if k > 1:
        assert 0 < sched.stats.spec_accepted_tokens < sched.stats.spec_draft_tokens
