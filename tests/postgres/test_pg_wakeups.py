"""How waiting PostgreSQL claimers are woken: one per notification, more while claims come back full."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from agent_dispatch.transport import Delivery
from agent_dispatch.transports.postgres import PostgresTransport
from tests.postgres.test_pg_claim_batch import turns

pytestmark = pytest.mark.postgres

#: Long enough that a claimer served within it was woken, not polling on its own.
POLL_S = 30.0


@pytest.fixture
def queue(postgres_dsn: str) -> Iterator[PostgresTransport]:
    q = PostgresTransport(
        postgres_dsn, max_depth=1_000, visibility_timeout_s=300, pool_max_size=8, poll_interval_s=POLL_S
    )
    q.ensure_ready()
    yield q
    q.close()


class Claimers:
    """``n`` threads, each waiting in one ``claim`` of up to ``max_items``."""

    def __init__(self, queue: PostgresTransport, n: int, max_items: int) -> None:
        self.got: dict[int, list[Delivery]] = {}
        self.errors: list[BaseException] = []
        self.attempts = 0  # claim statements run, counted around the transport's one-claim call
        self._lock = threading.Lock()
        claim_once = queue._claim_once

        def counted(owner: str, max_items: int) -> list[Delivery]:
            with self._lock:
                self.attempts += 1
            return claim_once(owner, max_items)

        queue._claim_once = counted  # type: ignore[method-assign]
        self.threads = [
            threading.Thread(target=self._claim, args=(queue, i, max_items), daemon=True) for i in range(n)
        ]
        for thread in self.threads:
            thread.start()

    def _claim(self, queue: PostgresTransport, i: int, max_items: int) -> None:
        try:
            got = queue.claim(f"w{i}", max_items=max_items, wait_s=POLL_S)
        except Exception as exc:  # the transport closed under a claimer still waiting at teardown
            self.errors.append(exc)
            return
        with self._lock:
            self.got[i] = got

    def served(self, n: int) -> int:
        """How many claimers got turns, once ``n`` have or after 10 s."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with self._lock:
                count = sum(1 for got in self.got.values() if got)
            if count >= n:
                return count
            time.sleep(0.01)
        return count


def _listening(queue: PostgresTransport) -> None:
    """Start the transport's listener and wait for it to LISTEN (it wakes everyone once then)."""
    waker = queue._get_waker()
    deadline = time.monotonic() + 10
    while waker.generation == 0:
        assert time.monotonic() < deadline, "the queue listener never connected"
        time.sleep(0.01)


def _settle(queue: PostgresTransport, claimers: Claimers) -> None:
    """Wait until every claimer sits in its wait (its first, empty claim done)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        waiting = queue._waker is not None and len(queue._waker._cond._waiters) == len(claimers.threads)  # type: ignore[attr-defined]
        if waiting:
            return
        time.sleep(0.01)
    raise AssertionError("the claimers never all waited")


def test_one_admitted_turn_wakes_one_claimer_not_all(queue: PostgresTransport) -> None:
    _listening(queue)
    claimers = Claimers(queue, 4, max_items=16)
    _settle(queue, claimers)
    before = claimers.attempts
    queue.admit(turns(0, 1))
    assert claimers.served(1) == 1
    time.sleep(0.5)
    # The others were not woken to find nothing: they still wait (until their poll interval).
    assert claimers.attempts - before == 1, f"{claimers.attempts - before} claims ran for one turn"
    assert not claimers.errors


def test_a_full_claim_passes_the_wake_up_on_until_the_queue_is_drained(queue: PostgresTransport) -> None:
    _listening(queue)
    claimers = Claimers(queue, 4, max_items=1)
    _settle(queue, claimers)
    queue.admit(turns(100, 3))  # one transaction: one notification
    assert claimers.served(3) == 3, "a full claim did not wake the next claimer"
    ids = {d.work_item_id for got in claimers.got.values() for d in got}
    assert len(ids) == 3
    assert not claimers.errors
