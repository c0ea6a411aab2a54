"""The PostgreSQL store's batched calls: one statement each, and a locked row is skipped, not waited for.

The behaviour every backend shares (what is started or committed, and what is left alone) is in
the contract suite; these are the properties only the PostgreSQL statements have.
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch.models import Outcome, SubmitRequest, SubmitResult, WorkState
from agent_dispatch.store import StartedTurn
from agent_dispatch.stores import postgres as pg
from agent_dispatch.stores.postgres import PostgresStore
from tests.contract._store_harness import store_settings

pytestmark = pytest.mark.postgres


@pytest.fixture
def store(postgres_dsn: str) -> Iterator[PostgresStore]:
    store = PostgresStore(postgres_dsn, store_settings(), max_size=2)
    store.migrate()
    yield store
    store.close()


def _submit(store: PostgresStore, n: int) -> list[str]:
    return [
        store.submit(SubmitRequest(tenant="t1", kind="turn", payload=f"p{i}".encode())).item.id
        for i in range(n)
    ]


def test_one_statement_starts_a_batch_and_one_commits_it(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _submit(store, 16)
    store.get(ids[0])  # the schema check is done once per store, before this count
    statements: list[str] = []
    execute = psycopg.Connection.execute

    def counting(self: psycopg.Connection[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        statements.append(str(query))
        return execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", counting)
    started = store.start_many("w1", [(item_id, "t1") for item_id in ids])
    assert len(statements) == 1 and len(started) == 16
    committed = store.commit_many([(turn.lease, Outcome.SUCCEEDED, None) for turn in started.values()])
    assert len(statements) == 2 and len(committed) == 16
    monkeypatch.undo()
    assert all(store.get(item_id).state is WorkState.SUCCEEDED for item_id in ids)


def test_start_many_skips_a_row_another_transaction_has_locked(
    store: PostgresStore, postgres_dsn: str
) -> None:
    locked, free = _submit(store, 2)
    result: dict[str, StartedTurn] = {}
    with psycopg.connect(postgres_dsn) as other:
        other.execute("SELECT 1 FROM agent_dispatch_work_items WHERE id = %s FOR UPDATE", (locked,))
        # A batch of two (START_MANY), then the locked row alone (START_ONE): both skip it.
        for claims in ([(locked, "t1"), (free, "t1")], [(locked, "t1")]):
            thread = threading.Thread(target=lambda c=claims: result.update(store.start_many("w1", c)))
            thread.start()
            thread.join(timeout=10)
            assert not thread.is_alive(), "start_many waited for a row lock instead of skipping the row"
        other.rollback()
    assert set(result) == {free}
    assert store.get(locked).state is WorkState.READY
    assert set(store.start_many("w1", [(locked, "t1")])) == {locked}


def _rows_read(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> int:
    """Rows the work-item table gave ``statement`` under its generic plan (the plan a pooled,
    prepared statement settles on), counted in the statement's own transaction."""
    with conn.transaction(force_rollback=True):
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        conn.execute(statement, params, prepare=True).fetchall()
        row = conn.execute(
            "SELECT pg_stat_get_xact_tuples_returned(c.oid) + pg_stat_get_xact_tuples_fetched(c.oid)"
            " FROM pg_class c WHERE c.relname = 'agent_dispatch_work_items'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_batch_statements_read_only_the_rows_they_name_whatever_the_queue_holds(
    store: PostgresStore, postgres_dsn: str
) -> None:
    """Joined to the unnested arrays, the generic plans scanned every active item (start_many)
    and every live lease (commit_many) per batch: a cost that grew with the queue. (A table of a
    few pages is rightly scanned whole, hence one big enough for the primary key to be cheaper.)"""
    requests = [SubmitRequest(tenant="t1", kind="turn", payload=b"p") for _ in range(4000)]
    ids = [r.item.id for r in store.submit_many_in_transaction(requests, lambda conn, items: None)]  # type: ignore[union-attr]
    held = store.start_many("w1", [(item_id, "t1") for item_id in ids[:300]], ttl_s=300)
    assert len(held) == 300
    named = ids[300:316]
    leases = [turn.lease for turn in list(held.values())[:16]]
    with psycopg.connect(postgres_dsn) as conn:
        started = _rows_read(
            conn,
            pg.START_MANY,
            {"off": 0.0, "owner": "w2", "ttl": 30.0, "ids": named, "tenants": ["t1"] * 16},
        )
        committed = _rows_read(
            conn,
            pg.COMMIT_MANY,
            {
                "off": 0.0,
                "ids": [lease.work_item_id for lease in leases],
                "tenants": [lease.tenant for lease in leases],
                "owners": [lease.owner for lease in leases],
                "epochs": [lease.lease_epoch for lease in leases],
                "tokens": [lease.fencing_token for lease in leases],
                "states": ["succeeded"] * 16,
                "outcomes": ["succeeded"] * 16,
                "errors": [None] * 16,
            },
        )
    # About 4 per named row (find and lock, then update by primary key); 4,000 active items or
    # 300 live leases would show here in the hundreds.
    assert started <= 100, f"start_many read {started} work-item rows for a batch of 16"
    assert committed <= 100, f"commit_many read {committed} work-item rows for a batch of 16"


def test_a_batch_of_one_is_read_by_primary_key_under_a_plan_made_on_an_empty_table(
    store: PostgresStore, postgres_dsn: str
) -> None:
    """A batch of one (an idle worker's claim) is started by START_ONE, whose scalar parameters let
    the plan cache keep a generic plan (START_MANY's arrays are planned afresh on every call), and
    committed by COMMIT_FAST for the same reason. A connection may make those plans while the table
    is nearly empty, as a worker started with the system does, and keep them while the table grows
    and holds hundreds of live leases: they must still read only the named row."""
    params: dict[str, Any] = {"off": 0.0, "owner": "w2", "ttl": 30.0, "id": "absent", "tenant": "t1"}
    commit: dict[str, Any] = {
        **params,
        "epoch": 1,
        "token": 1,
        "state": "succeeded",
        "outcome": "succeeded",
        "error": None,
    }
    with psycopg.connect(postgres_dsn) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.commit()
        with conn.transaction(force_rollback=True):
            assert conn.execute(pg.START_ONE, params, prepare=True).fetchall() == []
            assert conn.execute(pg.COMMIT_FAST, commit, prepare=True).fetchall() == []
        requests = [SubmitRequest(tenant="t1", kind="turn", payload=b"p") for _ in range(4000)]
        ids = [r.item.id for r in store.submit_many_in_transaction(requests, lambda conn, items: None)]  # type: ignore[union-attr]
        held = store.start_many("w3", [(item_id, "t1") for item_id in ids[1:301]])
        assert _rows_read(conn, pg.START_ONE, {**params, "id": ids[-1]}) <= 8
        lease = next(iter(held.values())).lease
        fenced = {"id": lease.work_item_id, "owner": lease.owner, "epoch": lease.lease_epoch}
        assert _rows_read(conn, pg.COMMIT_FAST, {**commit, **fenced, "token": lease.fencing_token}) <= 8
    # A batch of one goes by these scalar statements: started, then committed.
    started = store.start_many("w1", [(ids[0], "t1")])
    assert set(started) == {ids[0]} and store.get(ids[0]).state is WorkState.RUNNING
    committed = store.commit_many([(started[ids[0]].lease, Outcome.SUCCEEDED, None)])
    assert set(committed) == {ids[0]} and store.get(ids[0]).state is WorkState.SUCCEEDED


# Text that array literals must quote or escape: quotes, backslashes, braces, commas, spaces,
# the word NULL, non-ASCII. The batch statements send arrays in binary; this pins that every such
# value goes in and comes back unchanged (NUL is refused by PostgreSQL's text type itself).
_awkward_text = st.one_of(
    st.sampled_from(['a"b', "a\\b", "{x}", "a,b", " lead", "NULL", "null", "é—☃", "'", "\t"]),
    st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=24
    ),
).filter(lambda s: bool(s.strip()))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(
        st.tuples(
            _awkward_text,
            _awkward_text,
            st.one_of(st.none(), _awkward_text),
            st.one_of(st.none(), _awkward_text),
            st.binary(max_size=64),
            st.integers(-(2**31) + 1, 2**31 - 1),
            st.booleans(),
        ),
        min_size=1,
        max_size=12,
    ),
    error=_awkward_text,
)
def test_batches_round_trip_awkward_values(store: PostgresStore, rows: list[Any], error: str) -> None:
    deadline = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    requests = [
        SubmitRequest(
            tenant=tenant,
            kind=kind,
            payload=payload,
            session_id=session,
            fairness_group=group,
            priority=priority,
            deadline=deadline if with_deadline else None,
            idempotency_key=f"{uuid.uuid4()}{kind}",
        )
        for tenant, kind, session, group, payload, priority, with_deadline in rows
    ]
    results = store.submit_many_in_transaction(requests, lambda conn, items: None)
    assert all(isinstance(r, SubmitResult) and r.created for r in results), results
    items = [r.item for r in results if isinstance(r, SubmitResult)]
    for request, item in zip(requests, items, strict=True):
        stored = store.get(item.id)
        assert (stored.tenant, stored.kind, stored.fairness_group, stored.priority) == (
            request.tenant,
            request.kind,
            request.fairness_group,
            request.priority,
        )
        assert stored.session_id == (request.session_id or item.id)
        assert stored.deadline == request.deadline
        assert stored.idempotency_key == request.idempotency_key
        assert store.get_payload(item.id, tenant=request.tenant) == request.payload
    started = store.start_many('w"{1}', [(item.id, item.tenant) for item in items])
    assert {item_id: turn.payload for item_id, turn in started.items()} == {
        item.id: request.payload for request, item in zip(requests, items, strict=True)
    }
    committed = store.commit_many([(turn.lease, Outcome.FAILED, error) for turn in started.values()])
    assert {item_id: (c.state, c.error) for item_id, c in committed.items()} == {
        item.id: (WorkState.FAILED, error) for item in items
    }
