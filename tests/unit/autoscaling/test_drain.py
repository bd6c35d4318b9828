from __future__ import annotations

from dsv4_operator.autoscaling.drain import IdleRead, cancel, start, step

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
