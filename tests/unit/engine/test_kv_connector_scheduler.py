"""The scheduler side of PD, pure Python: decode requests park with their blocks until the KV
arrives and never run before; failures follow the policy; prefills keep their blocks exactly
until their KV was saved."""

from __future__ import annotations

import pytest

from dsv4_kvtransfer.pd_protocol import PrefillRequestParams, RemotePrefillParams
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.sched.scheduler import RunnerResult, Scheduler, SchedulerConfig
from dsv4_serving.engine.kv_connector.compat import KVCompat, KVIncompatible, KVPromptMismatch
from dsv4_serving.engine.kv_connector.metadata import KVConnectorOutput, KVTransferFailure
from dsv4_serving.engine.kv_connector.scheduler_side import SidecarConnectorScheduler
from dsv4_serving.engine.request import EngineCoreOutput, EngineCoreRequest, Request, RequestStatus
from dsv4_serving.engine.sample.sampling_params import SamplingParams

REMOTE = RemotePrefillParams(
    remote_engine_id="p",
    remote_request_id="r",
    remote_block_ids=(0, 1, 2),
    remote_host="127.0.0.1",
    remote_port=14579,
    remote_transfer_id="t",
    remote_lease_expires_at=0.0,
    remote_num_tokens=10,
    remote_total_bytes=1,
)
KVParams = PrefillRequestParams | RemotePrefillParams


def make(policy: str = "recompute", blocks: int = 64) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(blocks, 4, 4)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    return Scheduler(cfg, kv, SidecarConnectorScheduler(policy)), kv  # type: ignore[arg-type]


def req(rid: str, n: int, params: KVParams | None = None, max_tokens: int = 3) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(EngineCoreRequest(rid, list(range(1, n + 1)), sp, kv_transfer_params=params), 0)


def test_a_remote_prefill_request_parks_with_blocks_and_runs_only_after_its_kv() -> None:
    s, kv = make()
    r, local = req("d", 10, REMOTE), req("l", 5)
    s.add_request(r)
    s.add_request(local)
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["l"]  # the parked one does not run
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV and len(kv.block_ids("d")) == 3
    meta = s.connector.build_connector_meta()  # type: ignore[union-attr]
    assert [(x.request_id, x.params, x.block_ids, x.num_tokens) for x in meta.loads] == [
        ("d", REMOTE, kv.block_ids("d"), 10)
    ]
    s.update_from_connector(KVConnectorOutput(loaded=["d"]))
    out = s.schedule()
    d = next(x for x in out.scheduled if x.request_id == "d")
    assert d.context_len == 9 and d.token_ids == [10] and d.sample  # the last prompt token again


def test_recompute_policy_prefills_locally_and_fail_policy_errors() -> None:
    s, kv = make("recompute")
    s.add_request(req("d", 10, REMOTE))
    s.schedule()
    s.update_from_connector(KVConnectorOutput(failed={"d": KVTransferFailure("connection", "x")}))
    out = s.schedule()
    assert out.scheduled[0].context_len == 0 and len(out.scheduled[0].token_ids) == 10
    assert s.connector.stats.recomputes == 1  # type: ignore[union-attr]

    s, kv = make("fail")
    free = kv.num_free_blocks
    s.add_request(req("d", 10, REMOTE))
    s.schedule()
    s.update_from_connector(KVConnectorOutput(failed={"d": KVTransferFailure("auth", "bad token")}))
    outs = s.update_from_output(s.schedule(), {})
    assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [
        ("d", "error", KVTransferFailure("auth", "bad token"))
    ]
    assert kv.num_free_blocks == free and not s.has_unfinished_requests()


def test_an_incompatible_load_fails_even_under_recompute() -> None:
    s, _ = make("recompute")
    s.add_request(req("d", 6, REMOTE))
    s.schedule()
    s.update_from_connector(KVConnectorOutput(failed={"d": KVTransferFailure("incompatible", "x")}))
    assert [o.finish_reason for o in s.take_extra_outputs()] == ["error"]


def test_aborting_a_parked_request_frees_its_blocks_and_cancels_its_load() -> None:
    s, kv = make()
    free = kv.num_free_blocks
    s.add_request(req("d", 10, REMOTE))
    s.schedule()
    s.connector.build_connector_meta()  # type: ignore[union-attr]
    s.abort_requests(["d"])
    assert kv.num_free_blocks == free
    assert s.connector.build_connector_meta().cancelled == ["d"]  # type: ignore[union-attr]


def test_a_prefill_for_a_remote_decode_keeps_its_blocks_until_saved() -> None:
    s, kv = make()
    free = kv.num_free_blocks
    s.add_request(req("p", 9, PrefillRequestParams(), max_tokens=1))
    out = s.schedule()
    outs = s.update_from_output(out, {"p": RunnerResult([42])})
    saves = s.connector.take_saves()  # type: ignore[union-attr]
    assert [(x.request_id, x.num_tokens, x.first_token) for x in saves] == [("p", 9, 42)]
    assert kv.num_free_blocks == free - 3  # held for the export
    s.hold_saving_outputs(outs)
    assert outs == [] and s.has_unfinished_requests()  # the response waits for the export
    # steps go on meanwhile: the blocks stay allocated, nothing is sent for the request
    assert s.update_from_output(s.schedule(), {}) == []
    assert kv.num_free_blocks == free - 3
    # still running for a drain and the metrics: its client waits for the export's params
    assert (s.snapshot_stats().num_running, s.snapshot_stats().num_waiting) == (1, 0)
    s.saves_done({"p": REMOTE}, outs)
    assert kv.num_free_blocks == free and not s.has_unfinished_requests()
    assert s.snapshot_stats().num_running == 0
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("p", [42], "length")
    ]
    assert outs[0].kv_transfer_params is REMOTE


def test_a_failed_export_frees_the_blocks_and_errors_the_held_output() -> None:
    s, kv = make()
    free = kv.num_free_blocks
    s.add_request(req("p", 9, PrefillRequestParams(), max_tokens=1))
    s.add_request(req("l", 5, max_tokens=2))
    outs = s.update_from_output(s.schedule(), {"p": RunnerResult([42]), "l": RunnerResult([7])})
    s.hold_saving_outputs(outs)
    assert [o.request_id for o in outs] == ["l"]  # other requests' outputs are not held
    failure = KVTransferFailure("export_failed", "KV export failed: staging full")
    later: list[EngineCoreOutput] = []
    s.saves_done({"p": failure}, later)
    assert [(o.request_id, o.error) for o in later] == [("p", failure)]
    assert kv.num_free_blocks == free - 2  # only l's blocks are still allocated


def test_compat_refuses_other_layouts_and_other_prompts() -> None:
    mine = KVCompat("DeepseekV4ForCausalLM", 16, 1, "float32")
    params = KVCompat("DeepseekV4ForCausalLM", 16, 2, "float32").params_extra([1, 2, 3])
    with pytest.raises(KVIncompatible, match="num_speculative_tokens"):
        mine.check(params, [1, 2, 3])
    with pytest.raises(KVPromptMismatch):
        mine.check(mine.params_extra([1, 2, 3]), [1, 2, 4])
    mine.check(mine.params_extra([1, 2, 3]), [1, 2, 3])
    mine.check({}, [5])  # a peer that sends none of it: checked at import
