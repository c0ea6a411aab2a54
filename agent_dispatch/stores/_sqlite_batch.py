"""The SQLite store's batch calls in a few set statements: a submitter's batch of new items, and
a worker's ``start_many`` and ``commit_many``.

The engine's way (:mod:`agent_dispatch.stores._engine_fenced`) reads, checks and writes each item
alone; on SQLite that work runs under the file's only write lock, which the submitter and every
worker thread take in turn, so its length is what bounds the whole system's throughput there.
These take the same decisions in set statements (``sql/sqlite_batch.sql``) inside the store's
write transaction and record the same outcome events; the contract suite holds both to the same
tests.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Final, Protocol

from agent_dispatch.db import sql
from agent_dispatch.models import Lease, Outcome, OutcomeRecord, WorkItem
from agent_dispatch.store import StartedTurn, bound_error
from agent_dispatch.stores._common import COMMIT_STATE, Event, Prepared, make_item, require_dt
from agent_dispatch.stores._engine_rows import ROW_FIELDS, Row

_SQL: Final = sql.load(__package__ or "agent_dispatch.stores", "sql/sqlite_batch.sql")
_COMMIT_MANY: Final = _SQL["commit_many"].format(columns=", ".join(ROW_FIELDS))
#: Whether a row can be leased now: the one text every claim of the SQLite store uses.
CLAIMABLE: Final = _SQL["claimable"]
_START_CANDIDATES: Final = _SQL["start_candidates"].format(claimable=CLAIMABLE)
_LEASED: Final = frozenset({"leased", "running"})


class BatchTx(Protocol):
    """What these need of the SQLite store's transaction."""

    conn: sqlite3.Connection
    now: float

    def _rows(self, sql: str, params: dict[str, Any]) -> list[Row]: ...

    def append(self, record: OutcomeRecord) -> None: ...


def _record(
    tx: BatchTx, lease: Lease, event: Event, *, outcome: str | None = None, detail: str | None = None
) -> None:
    tx.append(
        OutcomeRecord(
            work_item_id=lease.work_item_id,
            tenant=lease.tenant,
            event=event.value,
            owner=lease.owner,
            lease_epoch=lease.lease_epoch,
            fencing_token=lease.fencing_token,
            at=require_dt(tx.now),
            outcome=outcome,
            detail=bound_error(detail),
        )
    )


def insert_new(tx: BatchTx, batch: list[Prepared], *, dispatched: bool) -> list[WorkItem] | None:
    """Store ``batch`` (requests without dependencies) as new ready items, in order; or write
    nothing and return ``None`` when any of them names an item that exists or another of the batch:
    the engine then answers each request alone (a repeat, or a conflict)."""
    ids = [p.id for p in batch]
    keys = [(p.tenant, p.idempotency_key) for p in batch if p.idempotency_key is not None]
    if len(set(ids)) != len(ids) or len(set(keys)) != len(keys):
        return None
    if tx.conn.execute(_SQL["any_existing"], {"ids": json.dumps(ids), "keys": json.dumps(keys)}).fetchone():
        return None
    rows = [Row.new(p, tx.now, pending=0, dispatched=dispatched) for p in batch]
    tx.conn.executemany(
        _SQL["insert_new"],
        [
            (
                r.id,
                r.tenant,
                r.kind,
                r.queue,
                r.session_id,
                r.priority,
                r.deadline,
                r.max_attempts,
                r.idempotency_key,
                r.fairness_group,
                p.payload,
                r.payload_size,
                r.payload_digest,
                r.created_at,
                r.updated_at,
                r.last_dispatched_at,
            )
            for r, p in zip(rows, batch, strict=True)
        ],
    )
    at = require_dt(tx.now)
    for r in rows:
        tx.append(OutcomeRecord(r.id, r.tenant, Event.SUBMIT.value, None, 0, 0, at))
    return [make_item(r.record()) for r in rows]


def start_many(tx: BatchTx, owner: str, wanted: list[tuple[str, str]], ttl: float) -> dict[str, StartedTurn]:
    """Lease and start the simply claimable items of ``wanted`` (id order); see ``StoreCalls.start_many``."""
    now = tx.now
    candidates = tx.conn.execute(_START_CANDIDATES, {"claims": json.dumps(wanted), "now": now}).fetchall()
    if not candidates:
        return {}
    (last,) = tx.conn.execute(_SQL["take_tokens"], {"n": len(candidates)}).fetchone()
    first = int(last) - len(candidates) + 1
    tokens = [[work_item_id, first + i] for i, (work_item_id, _, _) in enumerate(candidates)]
    params = {"tokens": json.dumps(tokens), "owner": owner, "now": now, "ttl": ttl}
    taken = {rec[0]: rec for rec in tx.conn.execute(_SQL["start_many"], params).fetchall()}
    started: dict[str, StartedTurn] = {}
    for work_item_id, state, previous in candidates:  # in id order, as the tokens were given
        item_id, tenant, holder, epoch, token, expires, attempt, payload = taken[work_item_id]
        lease = Lease(item_id, tenant, holder, epoch, token, require_dt(expires), attempt)
        reclaimed = previous is not None and state in _LEASED
        _record(
            tx,
            lease,
            Event.CLAIM,
            detail=f"reclaimed an expired lease held by {previous}" if reclaimed else None,
        )
        _record(tx, lease, Event.RUNNING)
        started[work_item_id] = StartedTurn(lease, bytes(payload))
    return started


def commit_many(tx: BatchTx, wanted: list[tuple[Lease, Outcome, str | None]]) -> dict[str, WorkItem]:
    """Commit every current lease of ``wanted`` whose item nobody depends on; see ``StoreCalls.commit_many``."""
    requests = [
        [
            lease.work_item_id,
            lease.tenant,
            lease.owner,
            lease.lease_epoch,
            lease.fencing_token,
            COMMIT_STATE[outcome].value,
            outcome.value,
            error,
        ]
        for lease, outcome, error in wanted
    ]
    committed = {
        row.id: row for row in tx._rows(_COMMIT_MANY, {"commits": json.dumps(requests), "now": tx.now})
    }
    result: dict[str, WorkItem] = {}
    for lease, outcome, error in wanted:  # in id order, as the engine records them
        row = committed.get(lease.work_item_id)
        if row is None:
            continue
        _record(tx, lease, Event.COMMIT, outcome=outcome.value, detail=error)
        result[row.id] = make_item(row.record())
    return result
