"""SQLite transport for local runs: ``agent_dispatch_queue`` in the WorkItem store's database file.

The file lives in the XDG data directory (``settings.sqlite_path``) in WAL mode. Every write
runs under ``BEGIN IMMEDIATE`` (SQLite's single writer lock taken up front), so:

- admission is compare-and-admit on a counter row, atomic and O(1) (never ``COUNT(*)``);
- a claim marks the rows it takes with the claimer's owner and a fresh token in the same
  transaction that chose them, so concurrent worker threads always get different rows; no thread
  reads a shared head row that another may also be taking;
- a receipt names the row, the owner and the per-claim token: once the visibility timeout has
  handed the row to another worker, the old receipt can neither acknowledge nor release it.

Claim order: expired deadlines first, priority (higher first), deadline, enqueue time, id. A
missing deadline is stored as a far-future ``deadline_key``, so one plain index matches the order
and a claim reads only the head of it (plus a probe of the expiry index), never the backlog.
Fairness across tenants is the PostgreSQL transport's job; local runs have one user.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from agent_dispatch.db import sql
from agent_dispatch.db.migrate import ComponentVersions, Schema, apply
from agent_dispatch.db.sqlite import ThreadConnections
from agent_dispatch.errors import BackendUnavailable, DepthUnavailable, Fenced, QueueFull
from agent_dispatch.settings import Backend, Settings
from agent_dispatch.transport import Delivery, OutboundTurn, Receipt

QUEUE: Final = "agent_dispatch_queue"
DEPTH: Final = "agent_dispatch_queue_depth"
_RECEIPT_PREFIX: Final = "sq1"
#: The queue's schema: its current shape asserted on every start (``ensure_ready``).
SCHEMA: Final = Schema(
    title="the queue schema",
    version=1,
    record=ComponentVersions("sqlite", "queue"),
    ensure=tuple(sql.load(__package__ or "agent_dispatch.transports", "sql/sqlite_queue.sql").values()),
)

#: ``deadline_key`` of a turn without a deadline: after every real one.
NO_DEADLINE: Final = 9.0e18
_ORDER: Final = "ORDER BY priority DESC, deadline_key, enqueued_at, id"
# Expired first (a range of the expiry index, empty in normal operation), then the order index's
# head; rows another worker holds are skipped by ``visible_at``, so workers take different rows.
# INDEXED BY: without statistics the planner would walk the order index past every live row.
_EXPIRED: Final = (
    f"SELECT id FROM {QUEUE} INDEXED BY {QUEUE}_expiry"
    f" WHERE deadline_key <= :now AND visible_at <= :now {_ORDER} LIMIT :n"
)
_NEXT: Final = f"SELECT id FROM {QUEUE} WHERE visible_at <= :now {_ORDER} LIMIT :n"
# A claim's rows (a JSON array of ids) under one fresh token; a batch of acknowledgements, each
# [id, owner, token], deleting only rows still held under exactly that claim.
_TAKE: Final = (
    f"UPDATE {QUEUE} SET claim_owner = ?, claim_token = ?, visible_at = ?, deliveries = deliveries + 1"
    " WHERE id IN (SELECT value FROM json_each(?)) RETURNING id, work_item_id, wire, deliveries"
)
_ACK: Final = (
    f"DELETE FROM {QUEUE} WHERE (id, claim_owner, claim_token) IN (SELECT json_extract(value, '$[0]'),"
    " json_extract(value, '$[1]'), json_extract(value, '$[2]') FROM json_each(?))"
    " RETURNING id, claim_owner, claim_token"
)


def _parse(token: str) -> tuple[int, str] | None:
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != _RECEIPT_PREFIX or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2]


def _counted_depth(conn: sqlite3.Connection) -> int:
    """The admission counter's depth; ``DepthUnavailable`` when its row is gone."""
    row = conn.execute(f"SELECT depth FROM {DEPTH} WHERE singleton = 1").fetchone()
    if row is None:
        raise DepthUnavailable("sqlite transport: the depth counter row is missing")
    return int(row[0])


class SqliteTransport:
    """The SQLite queue; thread-safe (one connection per thread), shareable by local processes."""

    backend = Backend.SQLITE

    def __init__(
        self,
        path: Path | str,
        *,
        max_depth: int,
        visibility_timeout_s: float,
        poll_interval_s: float = 0.25,
    ) -> None:
        self.path = Path(path)
        self.max_depth = max_depth
        self.visibility_timeout_s = visibility_timeout_s
        self.poll_interval_s = poll_interval_s
        self._db = ThreadConnections(self.path, "sqlite transport")
        # Wakes claimers in this process at once; other processes are found by polling.
        self._cond = threading.Condition()
        self._generation = 0
        self._wakeups = 0  # wake_claims() calls: a claim that sees it change returns
        self._ready = False

    @classmethod
    def from_settings(cls, settings: Settings) -> SqliteTransport:
        return cls(
            settings.sqlite_path,
            max_depth=settings.max_depth,
            visibility_timeout_s=settings.effective_visibility_timeout_s,
        )

    @property
    def database_identity(self) -> str:
        """The file, as the SQLite WorkItem store names it: equal means one transaction can span both."""
        return f"sqlite:{self.path.resolve()}"

    # -- lifecycle -------------------------------------------------------------------------

    def ensure_ready(self) -> None:
        if self._ready:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._db.transaction() as conn:
                apply(conn, SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise BackendUnavailable(f"sqlite transport unavailable ({type(exc).__name__}: {exc})") from None
        self._ready = True

    def close(self) -> None:
        self._db.close()
        self._wake()

    # -- admission ---------------------------------------------------------------------------

    def admit(self, turns: Sequence[OutboundTurn], *, bounded: bool = True) -> None:
        if not turns:
            return
        self._ensure_ready_for(DepthUnavailable)
        # Fail closed: a database that cannot be written is an unknown depth, never an empty queue.
        try:
            with self._db.transaction() as conn:
                self.admit_on(conn, turns, bounded=bounded)
        except (sqlite3.Error, BackendUnavailable) as exc:
            raise DepthUnavailable(f"sqlite transport: admission failed ({type(exc).__name__})") from None
        self._wake()

    def admit_on(
        self, conn: sqlite3.Connection, turns: Sequence[OutboundTurn], *, bounded: bool = True
    ) -> int:
        """Admit inside the caller's open write transaction on ``conn`` (the same database file).

        The enqueue path uses this to submit a WorkItem and admit its envelope atomically.
        Raises ``QueueFull``, or ``DepthUnavailable`` when the depth counter is gone (the caller
        rolls back); returns the number of rows inserted (a WorkItem that already has a queued
        delivery is skipped, never queued twice).
        """
        if not turns:
            return 0
        self.ensure_ready()
        now = self._db.now(conn)
        inserted = 0
        for turn in turns:
            visible_at = max(turn.not_before or now, now)
            cur = conn.execute(
                f"INSERT OR IGNORE INTO {QUEUE} (work_item_id, session_id, priority, deadline_key, enqueued_at,"
                " visible_at, wire) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    turn.work_item_id,
                    turn.session_id,
                    turn.priority,
                    NO_DEADLINE if turn.deadline is None else turn.deadline,
                    now,
                    visible_at,
                    turn.wire,
                ),
            )
            inserted += cur.rowcount
        if bounded:
            cur = conn.execute(
                f"UPDATE {DEPTH} SET depth = depth + :n WHERE singleton = 1 AND depth + :n <= :bound",
                {"n": inserted, "bound": self.max_depth},
            )
            if cur.rowcount != 1:
                _counted_depth(conn)  # a missing counter is an unknown depth, not a full queue
                raise QueueFull(f"sqlite queue: {inserted} more would exceed the bound {self.max_depth}")
        else:
            conn.execute(f"UPDATE {DEPTH} SET depth = depth + ? WHERE singleton = 1", (inserted,))
        return inserted

    def depth(self) -> int:
        self._ensure_ready_for(DepthUnavailable)
        try:
            with self._db.use() as conn:
                return _counted_depth(conn)
        except (sqlite3.Error, BackendUnavailable) as exc:
            raise DepthUnavailable(f"sqlite transport: depth probe failed ({type(exc).__name__})") from None

    # -- delivery ---------------------------------------------------------------------------

    def claim(self, owner: str, *, max_items: int = 1, wait_s: float = 0.0) -> list[Delivery]:
        if max_items < 1:
            return []
        self.ensure_ready()
        deadline = time.monotonic() + max(wait_s, 0.0)
        woken = self._wakeups
        while True:
            with self._cond:
                seen = self._generation
            got = self._claim_once(owner, max_items)
            remaining = deadline - time.monotonic()
            if got or remaining <= 0 or self._db.closed or self._wakeups != woken:
                return got
            self._wait(seen, min(remaining, self.poll_interval_s))

    def _claim_once(self, owner: str, max_items: int) -> list[Delivery]:
        out: list[Delivery] = []
        with self._db.transaction() as conn:
            now = self._db.now(conn)
            ids = [row[0] for row in conn.execute(_EXPIRED, {"now": now, "n": max_items})]
            if len(ids) < max_items:
                more = conn.execute(_NEXT, {"now": now, "n": max_items + len(ids)})
                ids += [row[0] for row in more if row[0] not in ids][: max_items - len(ids)]
            token = secrets.token_hex(16)
            params = (owner, token, now + self.visibility_timeout_s, json.dumps(ids))
            taken = {rec[0]: rec[1:] for rec in conn.execute(_TAKE, params)}
            for row_id in ids:
                work_item_id, wire, deliveries = taken[row_id]
                out.append(
                    Delivery(
                        wire=bytes(wire),
                        receipt=Receipt(owner, f"{_RECEIPT_PREFIX}.{row_id}.{token}"),
                        work_item_id=work_item_id,
                        redelivered=deliveries - 1,
                    )
                )
        return out

    def ack(self, receipt: Receipt) -> None:
        if self.ack_many([receipt]):
            raise Fenced("sqlite queue: the receipt is stale or foreign (the claim was reassigned)")

    def ack_many(self, receipts: Sequence[Receipt]) -> list[Receipt]:
        """Acknowledge a batch in one transaction; returns the receipts refused as stale or foreign."""
        self.ensure_ready()
        refused: list[Receipt] = []
        held: list[tuple[int, str, str] | None] = []
        for receipt in receipts:
            parsed = _parse(receipt.token)
            held.append(None if parsed is None else (parsed[0], receipt.owner, parsed[1]))
        with self._db.transaction() as conn:
            wanted = json.dumps([h for h in held if h is not None])
            deleted = set(conn.execute(_ACK, (wanted,)).fetchall())
            acked = 0
            for receipt, claim in zip(receipts, held, strict=True):
                if claim is not None and claim in deleted:
                    deleted.discard(claim)  # a receipt given twice acknowledges once
                    acked += 1
                else:
                    refused.append(receipt)
            if acked:
                conn.execute(f"UPDATE {DEPTH} SET depth = depth - ? WHERE singleton = 1", (acked,))
        return refused

    def release(self, receipt: Receipt, *, delay_s: float = 0.0) -> None:
        self.ensure_ready()
        parsed = _parse(receipt.token)
        if parsed is None:
            raise Fenced("sqlite queue: malformed receipt")
        with self._db.transaction() as conn:
            now = self._db.now(conn)
            cur = conn.execute(
                f"UPDATE {QUEUE} SET claim_owner = NULL, claim_token = NULL, visible_at = ?"
                " WHERE id = ? AND claim_owner = ? AND claim_token = ?",
                (now + max(delay_s, 0.0), parsed[0], receipt.owner, parsed[1]),
            )
            if cur.rowcount != 1:
                raise Fenced("sqlite queue: the receipt is stale or foreign (the claim was reassigned)")
        self._wake()

    # -- internals --------------------------------------------------------------------------

    def _ensure_ready_for(self, error: type[Exception]) -> None:
        try:
            self.ensure_ready()
        except BackendUnavailable as exc:
            raise error(str(exc)) from None

    def _wait(self, seen: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._generation != seen or self._db.closed, timeout=timeout)

    def _wake(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def wake_claims(self) -> None:
        with self._cond:
            self._wakeups += 1
        self._wake()
