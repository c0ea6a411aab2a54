"""The PostgreSQL store's batched calls: one statement each, and a locked row is skipped, not waited for.

The behaviour every backend shares (what is started or committed, and what is left alone) is in
the contract suite; these are the properties only the PostgreSQL statements have.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from agent_dispatch.models import Outcome, SubmitRequest, WorkState
from agent_dispatch.store import StartedTurn
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
        thread = threading.Thread(
            target=lambda: result.update(store.start_many("w1", [(locked, "t1"), (free, "t1")]))
        )
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "start_many waited for a row lock instead of skipping the row"
        other.rollback()
    assert set(result) == {free}
    assert store.get(locked).state is WorkState.READY
    assert set(store.start_many("w1", [(locked, "t1")])) == {locked}
