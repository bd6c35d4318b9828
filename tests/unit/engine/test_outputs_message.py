"""A step's ``Outputs`` message pickles its outputs as tuples (what crosses the process
boundary every step): the round trip gives back equal outputs, the usual decode output and
every kind with more fields (logprobs, a finish, an error, a prefill's KV params)."""

from __future__ import annotations

import pickle

from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_serving.engine.core.sched.scheduler import SchedulerStats
from dsv4_serving.engine.engine.messages import Outputs
from dsv4_serving.engine.kv_connector.metadata import KVTransferFailure
from dsv4_serving.engine.request import EngineCoreOutput, Logprob


def test_outputs_round_trip_equal_and_small() -> None:
    lp = [Logprob(7, -0.25, [(7, -0.25), (9, -2.0)])]
    kv = RemotePrefillParams("e", "r", (1, 2), "127.0.0.1", 1, "t", 9.0, 32, 1024)
    outs = [
        EngineCoreOutput("a", [5], num_cached_tokens=16),
        EngineCoreOutput("b", [7], lp),
        EngineCoreOutput("c", [1, 2], finish_reason="stop", stop_token_id=2),
        EngineCoreOutput("d", [3], finish_reason="length", kv_transfer_params=kv),
        EngineCoreOutput("e", [], finish_reason="error", error=KVTransferFailure("pull", "gone")),
    ]
    stats = SchedulerStats(num_running=4)
    stats.host_spans = [(0.001, 0.002, 0.003)]
    msg = Outputs(outs, stats, (stats, SchedulerStats()))
    back = pickle.loads(pickle.dumps(msg))
    assert back.outputs == outs and back.stats == stats and back.rank_stats == msg.rank_stats
    many = Outputs(
        [EngineCoreOutput(f"cmpl-{i}", [i], num_cached_tokens=0) for i in range(256)], stats
    )
    as_dataclasses = pickle.dumps([*many.outputs])
    assert len(pickle.dumps(many)) < len(as_dataclasses) * 3 // 4
    assert pickle.loads(pickle.dumps(many)).outputs == many.outputs
