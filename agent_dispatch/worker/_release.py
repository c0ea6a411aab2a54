"""The worker's commit, and the dependents it releases dispatched at once (not by the next sweep).

A successful commit can make dependents ``ready`` (their last dependency succeeded). Where the
queue shares the WorkItem store's database (the PostgreSQL queue on the PostgreSQL store, the
SQLite queue in the store's file) they are admitted inside the commit's own transaction
(:class:`agent_dispatch.store.TransactionalCommit`): committed and queued together, or neither.
Elsewhere (Kafka, or the in-process memory transport) they are admitted right after the commit.
Either way without the bound: they were accepted when submitted, and refusing them now would
only leave them to the sweep. The recovery sweep stays the safety net for what this misses (a
failed admission, a crash between commit and admission, a commit whose answer was lost).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from agent_dispatch.dispatch import build_turn, shares_database
from agent_dispatch.models import CommitResult, Lease, Outcome, WorkItem
from agent_dispatch.store import TransactionalCommit, WorkItemStore
from agent_dispatch.transport import AdmitOnConnection, OutboundTurn, Transport

log = logging.getLogger("agent_dispatch.worker")


class Committer:
    """Terminal commits for one store/transport pair, with the released dependents dispatched."""

    def __init__(self, store: WorkItemStore, transport: Transport, *, signing_key: bytes) -> None:
        self.store = store
        self.transport = transport
        self.signing_key = signing_key
        self._in_commit: tuple[TransactionalCommit, AdmitOnConnection] | None = None
        if (
            isinstance(store, TransactionalCommit)
            and isinstance(transport, AdmitOnConnection)
            and shares_database(store, transport)
        ):
            self._in_commit = (store, transport)

    @property
    def in_transaction(self) -> bool:
        """Whether released dependents are admitted inside the commit's transaction."""
        return self._in_commit is not None

    def commit(self, lease: Lease, outcome: Outcome, *, error: str | None = None) -> CommitResult:
        """``store.commit`` (terminal), then dispatch what it released and was not admitted in it."""
        admitted: set[str] = set()
        if self._in_commit is not None:
            store, queue = self._in_commit

            def admit_in_commit(conn: Any, released: list[WorkItem]) -> None:
                queue.admit_on(conn, self._turns(released), bounded=False)
                admitted.update(item.id for item in released)

            result = store.commit_in_transaction(lease, outcome, admit_in_commit, error=error)
        else:
            result = self.store.commit(lease, outcome, error=error)
        rest = [item for item in result.released if item.id not in admitted]
        if rest:
            self._admit_after_commit(rest)
        return result

    def _turns(self, items: Sequence[WorkItem]) -> list[OutboundTurn]:
        return [build_turn(item, signing_key=self.signing_key) for item in items]

    def _admit_after_commit(self, items: Sequence[WorkItem]) -> None:
        """Admit released items through the transport and record it; a failure leaves them to the
        sweep (the commit is done and must not be reported as failed)."""
        try:
            self.transport.admit(self._turns(items), bounded=False)
        except Exception:
            log.warning(
                "could not dispatch released dependents; the recovery sweep will",
                exc_info=True,
                extra={"released": len(items)},
            )
            return
        try:
            self.store.mark_dispatched([item.id for item in items])
        except Exception:
            # Admitted already: at worst the sweep re-drives them early, which the database
            # queues de-duplicate and workers absorb (a settled or leased item is skipped).
            log.warning("could not record the dispatch of released dependents", exc_info=True)
