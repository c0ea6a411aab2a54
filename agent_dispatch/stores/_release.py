"""The dependents a commit releases, dispatched inside that commit's transaction: one rule for
the SQL stores (:meth:`agent_dispatch.store.TransactionalCommit.commit_in_transaction`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from agent_dispatch.models import WorkItem

log = logging.getLogger("agent_dispatch.store")


def dispatch_released(
    savepoint: Callable[[], AbstractContextManager[object]],
    then: Callable[[Any, list[WorkItem]], None],
    conn: Any,
    released: Sequence[WorkItem],
    stamp: Callable[[list[str]], None],
) -> bool:
    """Run ``then(conn, released)`` and ``stamp`` their ids under ``savepoint``; whether both did.

    The commit matters more than the dispatch: if either fails, the savepoint undoes only their
    work, and the released items stay ready and unstamped, which the recovery sweep re-drives
    first (never dispatched counts as the oldest).
    """
    items = list(released)
    if not items:
        return True
    try:
        with savepoint():
            then(conn, items)
            stamp([item.id for item in items])
    except Exception:
        log.warning(
            "dispatching released dependents in the commit failed; they wait for the recovery sweep",
            exc_info=True,
            extra={"released": len(items)},
        )
        return False
    return True
