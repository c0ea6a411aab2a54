"""Polling until a condition holds: the one helper the suites against real services share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    predicate: Callable[[], Any], timeout: float = 60, interval: float = 0.5, what: str = "condition"
) -> Any:
    """Poll until ``predicate`` returns something truthy (returned); fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
