"""``dsv4 operator``'s stop: SIGTERM stops kopf (a thread of its own) and the process returns."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from dsv4_operator.cli import run_until_stopped


@pytest.fixture
def restore_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_sigterm_sets_the_stop_flag_and_a_finished_operator_returns_0(
    restore_signals: None,
) -> None:
    stop = threading.Event()
    seen: list[bool] = []

    def serve() -> None:
        seen.append(stop.wait(10))  # kopf returns once its stop flag is set

    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    assert run_until_stopped(serve, stop, idle=lambda: True) == 0
    assert seen == [True] and time.monotonic() - start < 5


def test_a_failure_of_the_operator_is_raised(restore_signals: None) -> None:
    def serve() -> None:
        raise RuntimeError("kopf failed to start")

    with pytest.raises(RuntimeError, match="kopf failed to start"):
        run_until_stopped(serve, threading.Event(), idle=lambda: True)
