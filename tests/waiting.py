"""Waiting in tests: on a condition, with a deadline, never on a fixed time.

A test that needs something to have happened (a file written, a process gone, a screen
redrawn) polls for it with :func:`wait_until` or, inside a Textual ``run_test()``, with
:func:`wait_for` (which lets the app run between two looks). The deadlines are generous: on a
loaded machine things take longer, but a condition that holds is seen at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Seconds a test waits for a condition unless it says otherwise.
DEADLINE = 60.0


def wait_until(predicate: Callable[[], T], timeout: float = DEADLINE, interval: float = 0.02,
               what: str | None = None) -> T:
    """Call ``predicate`` until it returns a true value, and return that value.

    Args:
        predicate: What the test needs (called at once, then every ``interval`` seconds).
        timeout: Seconds before giving up.
        interval: Seconds between two calls.
        what: Names the condition in the failure message.

    Raises:
        AssertionError: ``predicate`` was still false after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for "
                                 f"{what or getattr(predicate, '__name__', 'a condition')}")
        time.sleep(interval)


async def wait_for(pilot: Any, predicate: Callable[[], T], timeout: float = DEADLINE,
                   what: str | None = None) -> T:
    """Inside a Textual ``run_test()``: let the app run (``await pilot.pause()``, which waits
    for the screen's pending messages and refreshes) until ``predicate`` returns a true value,
    and return that value.

    Raises:
        AssertionError: ``predicate`` was still false after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for "
                                 f"{what or getattr(predicate, '__name__', 'a condition')}")
        await pilot.pause()
