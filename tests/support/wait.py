"""Waiting on a condition with a deadline (never a bare sleep)."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Call ``probe`` until it returns something truthy; fail with its last value past ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = probe()
            if last:
                return last
        except AssertionError:
            raise  # the probe saw something that can no longer come right
        except Exception as exc:  # keep trying; report the last failure if time runs out
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last saw: {last!r}")
        time.sleep(interval)  # noqa: sleep-ok (polling interval inside a deadline)
