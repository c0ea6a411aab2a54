"""The PostgreSQL queue's helpers: receipts, the LISTEN/NOTIFY waker and the maintenance thread."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow

from agent_dispatch.errors import BackendUnavailable
from agent_dispatch.transports.postgres import schema

log = logging.getLogger("agent_dispatch.transports.postgres")

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_RECEIPT_PREFIX: Final = "pg1"


def _ts(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _micros(value: datetime) -> int:
    return (value - _EPOCH) // timedelta(microseconds=1)


@dataclass(frozen=True)
class _Claim:
    """What a receipt token encodes: the row, its per-claim token and the claim timestamp."""

    row_id: int
    token: uuid.UUID
    claimed_at: datetime

    def encode(self) -> str:
        return f"{_RECEIPT_PREFIX}.{self.row_id}.{self.token.hex}.{_micros(self.claimed_at)}"

    @classmethod
    def decode(cls, token: str) -> _Claim | None:
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != _RECEIPT_PREFIX:
            return None
        try:
            return cls(int(parts[1]), uuid.UUID(hex=parts[2]), _EPOCH + timedelta(microseconds=int(parts[3])))
        except (ValueError, OverflowError):
            return None


class _Waker:
    """One listening connection per transport; claimers wait on it instead of polling hard.

    Notifications only shorten waits: claimers still poll at ``poll_interval_s``, so a lost
    connection or a notification sent while reconnecting costs latency, never a delivery.

    A notification wakes one waiting claimer, not all of them: every claim loop of a process
    woken by each admitted batch mostly found nothing left (two-thirds of all claims with four
    processes of four loops), and an empty claim costs the server as much as a full one. A
    claimer that fills its batch passes the wake-up on (:meth:`pass_on`), since more may wait.
    """

    def __init__(self, connect: Callable[[], psycopg.Connection[TupleRow]]) -> None:
        self._connect = connect
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.generation = 0
        self._thread = threading.Thread(target=self._run, name="agent-dispatch-pg-listen", daemon=True)
        self._thread.start()

    def _bump(self, *, everyone: bool = False) -> None:
        with self._cond:
            self.generation += 1
            if everyone:
                self._cond.notify_all()
            else:
                self._cond.notify()

    def wake_all(self) -> None:
        """Wake every waiting claimer (``PostgresTransport.wake_claims``)."""
        self._bump(everyone=True)

    def pass_on(self) -> None:
        """Wake one more waiting claimer: the last claim was full, so more work may be queued."""
        self._bump()

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                with self._connect() as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(schema.NOTIFY_CHANNEL)))
                    backoff = 0.5
                    self._bump(everyone=True)  # anything sent while we were not listening
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=0.5):
                            self._bump()
            except psycopg.Error as exc:
                log.debug("queue listener reconnecting after %s", type(exc).__name__)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def wait(self, seen: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.generation != seen or self._stop.is_set(), timeout=timeout)

    def close(self) -> None:
        self._stop.set()
        self._bump(everyone=True)
        self._thread.join(timeout=5)


class _Maintenance:
    """One thread per transport that claims: runs ``transport._maintain`` every ``tick_s``."""

    def __init__(self, maintain: Callable[[], None], tick_s: float) -> None:
        self._maintain = maintain
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agent-dispatch-pg-maintenance", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._tick_s):
            try:
                self._maintain()
            except (BackendUnavailable, psycopg.Error) as exc:  # claims report outages; retried next tick
                if not self._stop.is_set():  # (closing the pool under a pass fails it; nothing to report)
                    log.warning("queue maintenance failed: %s", exc)
            except Exception:
                log.exception("queue maintenance failed")

    def stop(self) -> None:
        """No further pass; one under way ends with it (see :meth:`join`)."""
        self._stop.set()

    def join(self) -> None:
        self._thread.join(timeout=5)
