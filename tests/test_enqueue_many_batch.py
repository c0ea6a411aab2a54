"""``enqueue_many`` with the store and the queue in one database (PostgreSQL, or one SQLite file):
one transaction for the whole batch.

Each request still gets its own outcome, in order: new items, repeats of an item submitted
earlier (in an earlier call or earlier in the same batch), idempotency conflicts and requests
whose envelope could never be sealed; only the new items are admitted, once each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch import dispatch
from agent_dispatch.envelope import open_envelope
from agent_dispatch.errors import DispatchError, InvalidRequest
from agent_dispatch.models import SubmitRequest, SubmitResult, WorkState, deterministic_id
from agent_dispatch.settings import Settings
from agent_dispatch.stores.postgres import PostgresStore
from agent_dispatch.stores.sqlite import SqliteStore
from agent_dispatch.transports.postgres import PostgresTransport
from agent_dispatch.transports.sqlite import SqliteTransport

KEY = b"batch-test-signing-key-0123456789abcdef"


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, Any, Settings]]:
    """The store and the queue in one database: PostgreSQL, or one SQLite file."""
    settings = Settings(max_depth=100, signing_key=KEY.decode())
    store: Any
    transport: Any
    if request.param == "postgres":
        dsn = request.getfixturevalue("postgres_dsn")
        store = PostgresStore(dsn, settings)
        transport = PostgresTransport(dsn, max_depth=100, visibility_timeout_s=60)
    else:
        path = tmp_path / "agent-dispatch.sqlite3"
        store = SqliteStore(path, settings)
        transport = SqliteTransport(path, max_depth=100, visibility_timeout_s=60)
    store.migrate()
    transport.ensure_ready()
    yield store, transport, settings
    transport.close()
    store.close()


def request(key: str, payload: bytes = b"{}", **kwargs: object) -> SubmitRequest:
    return SubmitRequest(tenant="tenant-a", kind="chat", payload=payload, idempotency_key=key, **kwargs)  # type: ignore[arg-type]


def test_one_batch_answers_each_request_and_admits_only_new_items(
    shared: tuple[Any, Any, Settings],
) -> None:
    store, transport, settings = shared
    earlier = dispatch.enqueue(store, transport, request("earlier"), signing_key=KEY, settings=settings).item

    requests = [
        request("new-1"),
        request("earlier"),  # a repeat of an item from an earlier call
        request("bad", session_id="has spaces"),  # its envelope could never be sealed
        request("new-2"),
        request("new-2"),  # a repeat within the same batch
        request("new-1", payload=b'{"other": 1}'),  # the same key with another body: a conflict
    ]
    outcomes = dispatch.enqueue_many(store, transport, requests, signing_key=KEY, settings=settings)

    assert len(outcomes) == len(requests)
    new1, again, bad, new2, new2_again, conflict = outcomes
    assert isinstance(new1, SubmitResult) and new1.created
    assert isinstance(again, SubmitResult) and not again.created and again.item.id == earlier.id
    assert isinstance(bad, InvalidRequest)
    assert isinstance(new2, SubmitResult) and new2.created
    assert (
        isinstance(new2_again, SubmitResult) and not new2_again.created and new2_again.item.id == new2.item.id
    )
    assert isinstance(conflict, DispatchError) and not isinstance(conflict, InvalidRequest)

    # One delivery per item: the earlier one and the two new ones.
    assert transport.depth() == 3
    delivered = {open_envelope(d.wire, KEY).job_id for d in transport.claim("w", max_items=10)}
    assert delivered == {earlier.id, new1.item.id, new2.item.id}
    for item_id in (new1.item.id, new2.item.id):
        assert store.get(item_id).state is WorkState.READY
    # Recorded as dispatched: the recovery sweep does not re-drive them.
    assert not {i.id for i in store.recoverable(stale_after_s=60)} & {new1.item.id, new2.item.id}
    assert deterministic_id("tenant-a", "bad") not in {
        o.item.id for o in outcomes if isinstance(o, SubmitResult)
    }


def test_the_submit_transaction_stamps_the_dispatch_time(shared: tuple[Any, Any, Settings]) -> None:
    """Admitted in the submit's own transaction, which records the dispatch: the recovery sweep
    does not re-drive a fresh item."""
    store, transport, settings = shared
    single = dispatch.enqueue(store, transport, request("single"), signing_key=KEY, settings=settings).item
    batch = dispatch.enqueue_many(
        store, transport, [request(f"b{i}") for i in range(5)], signing_key=KEY, settings=settings
    )
    ids = [single.id] + [r.item.id for r in batch if isinstance(r, SubmitResult)]
    assert len(ids) == 6
    assert store.recoverable(stale_after_s=3600) == []
    # A never-dispatched ready item is recoverable at once (NULL stamp): the check can fail.
    bare = store.submit(request("bare"))
    assert [i.id for i in store.recoverable(stale_after_s=3600)] == [bare.item.id]
