"""PostgreSQL plumbing shared by the WorkItem store and the queue: the retry rule and error text."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Final, TypeVar

from psycopg import errors

R = TypeVar("R")

#: Transactions the server rolled back whole to break a deadlock or a serialization conflict:
#: running them again is safe, and the usual cure.
RETRYABLE: Final = (errors.DeadlockDetected, errors.SerializationFailure)
ATTEMPTS: Final = 5


def retrying(transaction: Callable[[], R]) -> R:
    """Run ``transaction``; run it again (up to :data:`ATTEMPTS` in all, with a short jittered
    pause that grows) while the server picks it as a deadlock or serialization victim."""
    for attempt in range(ATTEMPTS):
        try:
            return transaction()
        except RETRYABLE:
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(random.uniform(0.001, 0.02) * (attempt + 1))  # noqa: S311 (jitter)
    raise AssertionError("unreachable")


def first_line(exc: BaseException) -> str:
    """An error's first line (psycopg's messages continue with context), or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
