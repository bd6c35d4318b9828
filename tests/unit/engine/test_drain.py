"""A drain's moves in the core (``engine/engine/drain.py``), pure Python: a named request moves
at its first step boundary past its first token, its blocks and slot kept for the export of
every token but its last; one still prefilling goes on until then; under async scheduling one
whose step is in flight gets no next step and moves once that step returned."""

from __future__ import annotations

from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.sched.async_scheduler import AsyncScheduler
from dsv4_serving.engine.core.sched.scheduler import RunnerResult, Scheduler, SchedulerConfig
from dsv4_serving.engine.engine.drain import Migrations
from dsv4_serving.engine.kv_connector.scheduler_side import SidecarConnectorScheduler
from dsv4_serving.engine.request import EngineCoreOutput, EngineCoreRequest, Request, RequestStatus
from dsv4_serving.engine.sample.sampling_params import SamplingParams


def _params(host_port: int, tid: str) -> RemotePrefillParams:
    return RemotePrefillParams("e", "r", (0,), "127.0.0.1", host_port, tid, 0.0, 10, 1)


PULLED = _params(1, "from-the-prefill")
EXPORTED = _params(2, "the-moved-sequence")


def make(cls: type[Scheduler] = Scheduler, connector: bool = True) -> Scheduler:
    kv = KVCacheManager(64, 4, 4)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    return cls(cfg, kv, SidecarConnectorScheduler() if connector else None)


def req(rid: str, n: int) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    return Request(EngineCoreRequest(rid, list(range(1, n + 1)), sp), 0)


def step(s: Scheduler, m: Migrations, token: int) -> list[str]:
    """One synchronous step as the core runs it; -> the ids scheduled."""
    m.run(s)
    with m.held_back(s):
        out = s.schedule()
    s.update_from_output(out, {x.request_id: RunnerResult([token]) for x in out.scheduled})
    return [x.request_id for x in out.scheduled]


def test_a_named_request_moves_at_its_next_boundary_with_its_kv_kept_for_export() -> None:
    s, m = make(), Migrations()
    s.add_request(req("a", 10))
    step(s, m, 100)
    step(s, m, 101)  # prompt 10 + 2 tokens, 11 forwarded
    blocks = s.kv.block_ids("a")
    m.add(["a", "gone"])
    m.run(s)
    assert not m.pending and not s.running and not s.requests
    saves = s.connector.take_saves()  # type: ignore[union-attr]
    assert [(x.request_id, x.num_tokens, x.prompt_token_ids, x.block_ids) for x in saves] == [
        ("a", 11, [*range(1, 11), 100, 101], blocks)
    ]
    outs = s.take_extra_outputs()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("a", [], "migrate")
    ]
    assert s.kv.block_ids("a") == blocks  # kept until the export ended (``saves_done``)


def test_the_migrate_output_waits_for_the_export_and_carries_its_params() -> None:
    """The moved stream's last output goes out only with its export's params (the gateway
    continues it by pulling them); a decode's request carries its own pull's params, which
    must not decide it (it went out without them, and the export stayed until its lease)."""
    s, m = make(), Migrations()
    r = req("a", 10)
    s.add_request(r)
    step(s, m, 100)
    step(s, m, 101)
    r.kv_transfer_params = PULLED  # as on a decode engine: how its prompt's KV came
    m.add(["a"])
    m.run(s)
    outs = s.take_extra_outputs()
    s.hold_saving_outputs(outs)
    assert outs == []  # held: its export runs
    later: list[EngineCoreOutput] = []
    s.saves_done({"a": EXPORTED}, later)
    assert [(o.request_id, o.finish_reason, o.kv_transfer_params) for o in later] == [
        ("a", "migrate", EXPORTED)
    ]
    assert s.kv.block_ids("a") == []  # freed with the export's end


def test_a_request_still_prefilling_moves_after_its_first_token() -> None:
    s, m = make(), Migrations()
    s.add_request(req("a", 10))
    m.add(["a"])
    assert step(s, m, 100) == ["a"]  # its prompt: it goes on
    assert m.pending == {"a"}
    m.run(s)
    assert not m.pending and s.requests == {}


def test_without_a_connector_the_move_frees_at_once() -> None:
    s, m = make(connector=False), Migrations()
    s.add_request(req("a", 10))
    step(s, m, 100)
    free = s.kv.num_free_blocks
    m.add(["a"])
    m.run(s)
    assert s.kv.num_free_blocks > free and not s.has_unfinished_requests()
    assert [o.finish_reason for o in s.take_extra_outputs()] == ["migrate"]


def test_under_async_scheduling_the_step_in_flight_returns_first() -> None:
    s, m = make(AsyncScheduler), Migrations()
    s.add_request(req("a", 10))
    first = s.schedule()  # prompt, samples token 0
    second = s.schedule()  # token 0's step, scheduled before token 0 is known
    s.update_from_output(first, {"a": RunnerResult([100])})
    r = s.requests["a"]
    assert r.num_output_tokens == 1 and r.num_output_placeholders == 1
    m.add(["a"])
    m.run(s)
    assert m.pending == {"a"}  # its step is in flight: not movable
    with m.held_back(s):
        third = s.schedule()
    assert third.scheduled == [] and s.running == [r]  # held back, not dropped
    s.update_from_output(second, {"a": RunnerResult([101])})
    m.run(s)
    assert not m.pending and r.status == RequestStatus.FINISHED_MIGRATED
    (save,) = s.connector.take_saves()  # type: ignore[union-attr]
    assert (save.num_tokens, save.prompt_token_ids[-2:]) == (11, [100, 101])


def test_a_sigterm_drain_starts_with_the_moves() -> None:
    """``Drain.on_start`` (an engine with a KV sidecar: ``AsyncLLM.migrate``) runs as the drain
    begins, before its wait for in-flight work."""
    import asyncio

    from dsv4_serving.http.disconnect import Drain

    calls: list[int] = []

    async def test() -> None:
        drain = Drain(poll_s=0.01)
        drain.held = 1
        drain.on_start = lambda: calls.append(drain.held)

        async def moved() -> None:
            await asyncio.sleep(0.05)
            drain.held -= 1

        task = asyncio.create_task(moved())
        assert await drain.run(timeout_s=5.0) == 0
        await task

    asyncio.run(test())
    assert calls == [1]
