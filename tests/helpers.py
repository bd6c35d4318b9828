"""Small helpers shared by the test tiers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    what: str, fn: Callable[[], T | None], timeout_s: float = 60.0, every_s: float = 0.25
) -> T:
    """Poll ``fn`` until it returns something truthy; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
