from __future__ import annotations

from dsv4_operator.autoscaling.drain import (
    DrainAnswer,
    IdleRead,
    asked,
    cancel,
    parse_answer,
    start,
    step,
    with_answer,
)

TIMEOUT, GAP = 600.0, 2.0


def test_completes_on_two_idle_reads_a_gap_apart() -> None:
    d, ev = start("v4-decode-1", "decode", 0.0, IdleRead(0.0, running=16, waiting=0))
    assert ev.reason == "DrainStarted"
    assert ev.message == "decode instance v4-decode-1: no new requests (16 in flight)"
    d, out, ev2 = step(d, IdleRead(15.0, running=3, waiting=0), 15.0, TIMEOUT, GAP)
    assert (out, ev2) == ("draining", None)
    d, out, ev2 = step(d, IdleRead(30.0, 0, 0), 30.0, TIMEOUT, GAP)
    assert out == "draining" and d.idle_since == 30.0
    d, out, ev2 = step(d, IdleRead(31.0, 0, 0), 31.0, TIMEOUT, GAP)
    assert out == "draining"  # 1 s apart is within one gateway health interval
    d, out, ev2 = step(d, IdleRead(45.0, 0, 0), 45.0, TIMEOUT, GAP)
    assert out == "completed"
    assert ev2 is not None and ev2.reason == "DrainCompleted"
    assert ev2.message == "decode instance v4-decode-1 idle after 45s, 16 in flight at start"


def test_a_late_request_restarts_the_idle_count() -> None:
    d, _ = start("v4-decode-1", "decode", 0.0, None)
    d, out, _ = step(d, IdleRead(10.0, 0, 0), 10.0, TIMEOUT, GAP)
    d, out, _ = step(d, IdleRead(11.0, running=1, waiting=0), 11.0, TIMEOUT, GAP)
    assert d.idle_since is None
    d, out, _ = step(d, IdleRead(20.0, 0, 0), 20.0, TIMEOUT, GAP)
    assert out == "draining"
    d, out, ev = step(d, IdleRead(25.0, 0, 0), 25.0, TIMEOUT, GAP)
    assert out == "completed" and ev is not None
    assert ev.message == "decode instance v4-decode-1 idle after 25s"


def test_prefill_waits_for_its_kv_exports() -> None:
    d, _ = start("v4-prefill-1", "prefill", 0.0, IdleRead(0.0, 0, 0, exports=2))
    d, out, _ = step(d, IdleRead(5.0, 0, 0, exports=2), 5.0, TIMEOUT, GAP)
    d, out, _ = step(d, IdleRead(10.0, 0, 0, exports=1), 10.0, TIMEOUT, GAP)
    assert out == "draining"
    d, out, _ = step(d, IdleRead(15.0, 0, 0, exports=0), 15.0, TIMEOUT, GAP)
    d, out, _ = step(d, IdleRead(20.0, 0, 0, exports=0), 20.0, TIMEOUT, GAP)
    assert out == "completed"


def test_times_out_with_a_warning_when_never_idle_or_unreachable() -> None:
    d, _ = start("v4-decode-1", "decode", 0.0, None)
    d, out, ev = step(d, IdleRead(5.0, running=2, waiting=1), 5.0, 5.0, GAP)
    assert out == "timed_out" and ev is not None and ev.type == "Warning"
    assert "not idle after 5s (3 still in flight)" in ev.message
    d, _ = start("v4-decode-1", "decode", 0.0, None)
    d, out, ev = step(d, None, 9.0, 5.0, GAP)
    assert out == "timed_out" and ev is not None and "(unreachable)" in ev.message


def test_cancel_event() -> None:
    d, _ = start("v4-decode-1", "decode", 0.0, None)
    ev = cancel(d, "decode scales up again")
    assert (ev.reason, ev.message) == (
        "DrainCancelled",
        "decode instance v4-decode-1: decode scales up again",
    )


def test_the_first_drain_answer_posts_drain_migrating_and_later_ones_only_ask_again() -> None:
    d, _ = start("v4-decode-1", "decode", 0.0, IdleRead(0.0, running=16, waiting=0))
    d2, ev = asked(d, None)  # the call failed: nothing recorded, the next tick asks again
    assert (d2, ev) == (d, None)
    d, ev = asked(d, DrainAnswer(migrating=14, in_flight=16, kv=True))
    assert d.moving == 14
    assert ev is not None and (ev.type, ev.reason, ev.message) == (
        "Normal",
        "DrainMigrating",
        "decode instance v4-decode-1: 14 stream(s) moving with their KV, 16 in flight",
    )
    # a later answer counts the streams still there (moving or not): not added, no event
    d, ev = asked(d, DrainAnswer(migrating=3, in_flight=3, kv=True))
    assert (d.moving, ev) == (14, None)
    d, out, _ = step(d, IdleRead(4.0, 0, 0, exports=0), 4.0, TIMEOUT, GAP)
    d, out, ev = step(d, IdleRead(6.0, 0, 0, exports=0), 6.0, TIMEOUT, GAP)
    assert out == "completed" and ev is not None
    assert ev.message == (
        "decode instance v4-decode-1 idle after 6s, 16 in flight at start, 14 asked to move"
    )


def test_without_a_sidecar_the_streams_move_without_kv() -> None:
    d, _ = start("v4-decode-1", "decode", 0.0, None)
    d, ev = asked(d, DrainAnswer(migrating=2, in_flight=2, kv=False))
    assert ev is not None and ev.message == (
        "decode instance v4-decode-1: 2 stream(s) moving without KV (recomputed where they go), "
        "2 in flight"
    )


def test_a_decode_drain_waits_for_the_peers_to_pull_the_moved_kv() -> None:
    d, _ = start("v4-decode-1", "decode", 0.0, IdleRead(0.0, running=4, waiting=0))
    d, _ = asked(d, DrainAnswer(migrating=4, in_flight=4, kv=True))
    # the streams left the batch, their KV is held for the peers: not idle yet
    d, out, _ = step(d, IdleRead(1.0, 0, 0, exports=4), 1.0, TIMEOUT, GAP)
    d, out, _ = step(d, IdleRead(2.0, 0, 0, exports=1), 2.0, TIMEOUT, GAP)
    assert out == "draining" and d.idle_since is None
    d, out, _ = step(d, IdleRead(3.0, 0, 0, exports=0), 3.0, TIMEOUT, GAP)
    d, out, _ = step(d, IdleRead(5.0, 0, 0, exports=0), 5.0, TIMEOUT, GAP)
    assert out == "completed"


def test_parse_answer_takes_the_engines_answer_only() -> None:
    ok = {"draining": True, "migrating": 3, "in_flight": 5, "kv": True}
    assert parse_answer(ok) == DrainAnswer(3, 5, True)
    assert parse_answer({**ok, "draining": False}) is None
    assert parse_answer({**ok, "migrating": "3"}) is None
    assert parse_answer({**ok, "kv": 1}) is None
    assert parse_answer({k: v for k, v in ok.items() if k != "in_flight"}) is None
    assert parse_answer([ok]) is None


def test_the_drain_answers_in_flight_count_stands_for_the_cores_gauges() -> None:
    """After the streams moved, the core's gauges may still count them (stale): the front
    end's count of requests in flight, from this tick's answer, decides."""
    stale = IdleRead(3.0, running=2, waiting=1, exports=0)
    assert with_answer(stale, DrainAnswer(0, 0, True)) == IdleRead(3.0, 0.0, 0.0, 0.0)
    assert with_answer(stale, DrainAnswer(0, 2, True)) == IdleRead(3.0, 2.0, 0.0, 0.0)
    assert with_answer(stale, None) == stale  # no answer this tick: the gauges stand
    assert with_answer(None, DrainAnswer(0, 0, True)) is None  # an unreadable sidecar is not idle
    held = IdleRead(3.0, running=2, waiting=0, exports=1)
    assert with_answer(held, DrainAnswer(0, 0, True)).busy == 1  # type: ignore[union-attr]
