"""The stores' count of unfinished WorkItems (schema v2): the admission bound on Kafka.

It must equal the number of items in ``submitted``, ``ready``, ``leased`` or ``running`` after
every kind of transition (the database keeps it with triggers, whoever writes), and a bounded
submit compares and admits against it in its own transaction: a refusal keeps nothing, a replay
is never refused, concurrent submitters never take the same room; an operator's bounded retry of a
dead letter takes its room under the same count. SQLite and a real PostgreSQL.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agent_dispatch.errors import DispatchError, QueueFull
from agent_dispatch.models import Lease, Outcome, SubmitRequest, SubmitResult, WorkItem, WorkState
from agent_dispatch.store import (
    BatchSubmit,
    CountsUnfinished,
    Inspectable,
    TransactionalSubmit,
    WorkItemStore,
)
from agent_dispatch.stores._common import COMPONENT, prepare_submit
from agent_dispatch.stores.postgres import PostgresStore
from tests.contract._store_harness import (  # noqa: F401 (store_postgres_dsn is a fixture)
    DB_BACKENDS,
    Harness,
    open_harness,
    store_postgres_dsn,
)

TENANTS = ("t1", "t2")


@pytest.fixture(params=DB_BACKENDS)
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    with open_harness(request.param, request, tmp_path) as harness:
        assert isinstance(harness.store, CountsUnfinished)
        yield harness


def truth(store: WorkItemStore) -> int:
    """The count the slow way (every item read back), to hold the O(1) counter against."""
    items = [i for t in TENANTS for i in store.list_items(tenant=t, limit=1000)]
    return sum(not item.state.terminal for item in items)


def counted(store: WorkItemStore) -> int:
    assert isinstance(store, CountsUnfinished)
    got = store.unfinished()
    assert got == truth(store)
    return got


def request(key: str | None = None, tenant: str = "t1", **kw: Any) -> SubmitRequest:
    return SubmitRequest(tenant=tenant, kind="turn", payload=b"{}", idempotency_key=key, **kw)


#: ``request`` under a name the tests taking pytest's ``request`` fixture can still call.
keyed = request


def submit(store: WorkItemStore, **kw: Any) -> WorkItem:
    result = store.submit(request(**kw))
    assert result.created
    return result.item


def lease(store: WorkItemStore, item: WorkItem) -> Lease:
    got = store.claim("w1", work_item_id=item.id)
    assert got is not None
    return got


def bounded(store: WorkItemStore, req: SubmitRequest, bound: int) -> SubmitResult:
    assert isinstance(store, CountsUnfinished) and isinstance(store, TransactionalSubmit)
    counter = store
    return store.submit_in_transaction(
        req, lambda conn, item: counter.admit_unfinished(conn, [item], bound), dispatched=True
    )


def test_the_count_follows_every_transition(h: Harness) -> None:
    s = h.store
    assert counted(s) == 0
    a = submit(s)
    b = submit(s, depends_on=(a.id,))
    c = submit(s, depends_on=(b.id,))
    assert counted(s) == 3  # a dependent waiting is accepted and unfinished
    held = lease(s, a)
    assert counted(s) == 3  # leased, running: still unfinished
    s.commit(s.mark_running(held), Outcome.SUCCEEDED)
    assert s.get(b.id).state is WorkState.READY
    assert counted(s) == 2
    s.cancel(b.id, tenant="t1", reason="user")  # cascades to c
    assert s.get(c.id).state is WorkState.CANCELLED
    assert counted(s) == 0
    # Retries spend attempts back to ready (no change), the last one dead-letters (-1).
    d = submit(s, max_attempts=2)
    s.retry(lease(s, d), error="boom")
    assert counted(s) == 1
    h.advance(400)
    s.retry(lease(s, d), error="boom")
    assert s.get(d.id).state is WorkState.DEAD_LETTER
    assert counted(s) == 0
    # An operator's retry of a dead-lettered item makes it unfinished again.
    assert isinstance(s, Inspectable)
    s.retry_dead_letter(d.id, tenant="t1", reason="operator")
    assert counted(s) == 1
    s.dead_letter(d.id, reason="poison")
    assert counted(s) == 0
    # Deadlines: expiry cancels, also a dependent cancelled by its expired dependency.
    now = s.now()
    e = submit(s, tenant="t2", deadline=now + timedelta(seconds=5))
    submit(s, tenant="t2", depends_on=(e.id,))
    f = submit(s, tenant="t2")
    assert counted(s) == 3
    h.advance(30)
    s.expire()
    assert counted(s) == 1
    # A batch commit, and a submit whose dependency already failed (stored cancelled at once).
    s.commit_many([(s.mark_running(lease(s, f)), Outcome.FAILED, "boom")])
    assert counted(s) == 0
    assert s.submit(request(tenant="t2", depends_on=(f.id,))).item.state is WorkState.CANCELLED
    assert counted(s) == 0


def test_a_bounded_submit_refuses_past_the_bound_and_keeps_nothing(h: Harness) -> None:
    s = h.store
    first = bounded(s, request("a"), bound=2)
    bounded(s, request("b"), bound=2)
    with pytest.raises(QueueFull):
        bounded(s, request("c"), bound=2)
    assert [i.idempotency_key for i in s.list_items(tenant="t1")] == ["b", "a"]
    # A replay is answered whatever the count (it creates nothing), also past a lowered bound.
    again = bounded(s, request("a"), bound=1)
    assert (again.created, again.item.id) == (False, first.item.id)
    assert counted(s) == 2
    # Room comes back when an item finishes, not before.
    s.commit(s.mark_running(lease(s, first.item)), Outcome.SUCCEEDED)
    assert bounded(s, request("c"), bound=2).created
    assert counted(s) == 2


def test_a_bounded_batch_is_all_or_nothing(h: Harness) -> None:
    s = h.store
    assert isinstance(s, BatchSubmit) and isinstance(s, CountsUnfinished)
    counter = s

    def admit(conn: Any, items: list[WorkItem]) -> None:
        counter.admit_unfinished(conn, items, 3)

    results = s.submit_many_in_transaction([request(f"k{i}") for i in range(2)], admit, dispatched=True)
    assert all(isinstance(r, SubmitResult) and r.created for r in results)
    with pytest.raises(QueueFull):
        s.submit_many_in_transaction([request(f"k{i}") for i in range(4)], admit, dispatched=True)
    assert counted(s) == 2
    # The two replays plus one new item fit.
    results = s.submit_many_in_transaction([request(f"k{i}") for i in range(3)], admit, dispatched=True)
    assert [isinstance(r, SubmitResult) and r.created for r in results] == [False, False, True]
    assert counted(s) == 3


def race(lanes: list[list[Callable[[], str]]]) -> list[str]:
    """Each lane in its own thread, its attempts in order, all lanes at once; returns the ids the
    attempts admitted (a ``QueueFull`` refusal admits nothing; any other error fails the test)."""
    admitted: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(lane: list[Callable[[], str]]) -> None:
        for attempt in lane:
            try:
                admitted_id = attempt()
            except QueueFull:
                continue
            except DispatchError as exc:  # pragma: no cover - reported below
                errors.append(exc)
                continue
            with lock:
                admitted.append(admitted_id)

    threads = [threading.Thread(target=run, args=(lane,)) for lane in lanes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return admitted


def submit_attempts(store: Any, prefix: str, count: int, bound: int) -> list[Callable[[], str]]:
    return [lambda n=n: bounded(store, request(f"{prefix}-{n}"), bound).item.id for n in range(count)]


def test_concurrent_bounded_submitters_never_exceed_the_bound(h: Harness) -> None:
    bound, per_thread, threads = 7, 12, 6
    accepted = race([submit_attempts(h.open(), f"s{i}", per_thread, bound) for i in range(threads)])
    assert len(accepted) == bound
    assert counted(h.store) == bound


def test_concurrent_bounded_retries_and_submits_never_exceed_the_bound(h: Harness) -> None:
    """Operators' retries of dead letters take room under the same count as submits: racing
    each other from several connections, they are admitted exactly up to the bound."""
    bound, dead, submitters, per_submitter = 6, 8, 3, 4
    s = h.store
    assert isinstance(s, Inspectable)
    letters = [submit(s, key=f"dead-{n}") for n in range(dead)]
    for item in letters:
        s.dead_letter(item.id, reason="poison")
    assert counted(s) == 0

    def retry(store: Any, item_id: str) -> str:
        assert isinstance(store, Inspectable)
        store.retry_dead_letter(item_id, tenant="t1", reason="operator", bound=bound)
        return item_id

    lanes = [[functools.partial(retry, h.open(), item.id)] for item in letters]
    lanes += [submit_attempts(h.open(), f"s{i}", per_submitter, bound) for i in range(submitters)]
    admitted = race(lanes)
    assert len(admitted) == bound
    assert counted(h.store) == bound
    # Every refused retry left its item dead-lettered.
    refused = [item.id for item in letters if item.id not in admitted]
    assert all(s.get(x).state is WorkState.DEAD_LETTER for x in refused)


@pytest.mark.postgres
def test_the_postgres_migration_counts_what_is_already_there(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Upgrading a database from schema 1 counts the unfinished items it holds."""
    with open_harness("postgres", request, tmp_path) as harness:
        s = harness.store
        assert isinstance(s, PostgresStore)
        done = submit(s)
        submit(s)
        s.commit(s.mark_running(lease(s, done)), Outcome.SUCCEEDED)
        with psycopg.connect(s._dsn, autocommit=True) as conn:
            conn.execute(
                "DROP TABLE agent_dispatch_unfinished; DROP FUNCTION agent_dispatch_count_unfinished CASCADE;"
                " DROP FUNCTION agent_dispatch_note_unfinished CASCADE"
            )
            conn.execute(
                "DELETE FROM agent_dispatch_schema_version WHERE component = %s AND version >= 2",
                (COMPONENT,),
            )
        assert counted(harness.open(migrate=True)) == 1


def _to_schema_2(dsn: str) -> None:
    """Put a current database back to schema 2: v2.sql's per-row counter, v3's triggers gone."""
    v2 = resources.files("agent_dispatch.stores.postgres").joinpath("sql/v2.sql").read_text()
    function = re.search(r"CREATE FUNCTION agent_dispatch_count_unfinished\(\).*?\$\$;", v2, re.DOTALL)
    assert function is not None
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP FUNCTION agent_dispatch_note_unfinished CASCADE")
        conn.execute(function.group(0).replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
        conn.execute(
            "DELETE FROM agent_dispatch_schema_version WHERE component = %s AND version = 3", (COMPONENT,)
        )


@pytest.mark.postgres
def test_the_postgres_upgrade_to_schema_3_keeps_the_count(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Schema 3 sums a transaction's changes and writes the row once: the count stays exact
    across the upgrade, in batches, and when a savepoint rolls back part of a transaction."""
    with open_harness("postgres", request, tmp_path) as harness:
        s = harness.store
        assert isinstance(s, PostgresStore)
        _to_schema_2(s._dsn)
        done = submit(s)
        kept = submit(s)
        s.commit(s.mark_running(lease(s, done)), Outcome.SUCCEEDED)
        assert counted(s) == 1
        s = harness.open(migrate=True)
        assert isinstance(s, PostgresStore)
        assert counted(s) == 1
        results = s.submit_many_in_transaction([keyed(f"b{i}") for i in range(5)], lambda conn, items: None)
        assert counted(s) == 6
        leases = [lease(s, r.item) for r in results if isinstance(r, SubmitResult)] + [lease(s, kept)]
        s.commit_many([(s.mark_running(held), Outcome.SUCCEEDED, None) for held in leases[:4]])
        assert counted(s) == 2

        def partly_rolled_back(conn: Any) -> None:
            s._submit(conn, prepare_submit(keyed("outer"), s.limits))
            with contextlib.suppress(RuntimeError), conn.transaction():  # a savepoint
                s._submit(conn, prepare_submit(keyed("inner"), s.limits))
                raise RuntimeError("roll the savepoint back")

        s._run(partly_rolled_back)
        assert counted(s) == 3
        assert s.get(prepare_submit(keyed("outer"), s.limits).id).state is WorkState.READY
