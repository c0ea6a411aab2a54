"""The SQLite store's batch submit (set statements when the batch is all new) answers every batch
exactly as submitting its requests one at a time does: the same items created, the same repeats,
the same conflicts and refusals, the same stored items and events."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch.errors import DispatchError
from agent_dispatch.models import SubmitRequest, SubmitResult
from agent_dispatch.stores.sqlite import SqliteStore
from tests.contract._store_harness import store_settings

_TENANTS = st.sampled_from(["t1", "t2"])
_KEYS = st.one_of(st.none(), st.sampled_from(["k1", "k2", "k3"]))
_IDS = st.one_of(st.none(), st.sampled_from(["id-a", "id-b"]))
_REQUESTS = st.builds(
    SubmitRequest,
    tenant=_TENANTS,
    kind=st.sampled_from(["chat", "tool"]),
    payload=st.sampled_from([b"{}", b'{"x": 1}']),
    idempotency_key=_KEYS,
    work_item_id=_IDS,
    priority=st.integers(-2, 2),
    session_id=st.one_of(st.none(), st.just("s1"), st.just("bad session")),
)


def _answer(outcome: SubmitResult | DispatchError) -> tuple[Any, ...]:
    if isinstance(outcome, DispatchError):
        return ("error", type(outcome).__name__)
    item = outcome.item
    # Random ids (no key, no explicit id) differ between the two stores; the rest must not.
    item_id = item.id if item.idempotency_key or item.id.startswith("id-") else "random"
    return (
        "created" if outcome.created else "repeat",
        item_id,
        item.tenant,
        item.kind,
        item.state,
        item.priority,
        item.attempt,
        item.session_id == item.id,
    )


def _stored(store: SqliteStore) -> list[tuple[Any, ...]]:
    with store._read() as tx:
        rows = tx.conn.execute(
            "SELECT tenant, kind, state, priority, idempotency_key, payload_digest, last_dispatched_at IS NULL,"
            " (SELECT group_concat(event) FROM agent_dispatch_outcomes o WHERE o.work_item_id = w.id)"
            " FROM agent_dispatch_work_items w ORDER BY tenant, idempotency_key, kind, priority"
        ).fetchall()
    return sorted(rows, key=repr)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(earlier=st.lists(_REQUESTS, max_size=3), batch=st.lists(_REQUESTS, max_size=6))
def test_a_batch_answers_as_its_requests_one_at_a_time(
    earlier: list[SubmitRequest], batch: list[SubmitRequest]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        batched = SqliteStore(Path(tmp) / "batched.sqlite3", store_settings())
        single = SqliteStore(Path(tmp) / "single.sqlite3", store_settings())
        try:
            for store in (batched, single):
                store.migrate()
                for request in earlier:
                    with contextlib.suppress(DispatchError):
                        store.submit(request)
            together = batched.submit_many_in_transaction(batch, lambda conn, items: None, dispatched=True)
            alone: list[SubmitResult | DispatchError] = []
            for request in batch:
                try:
                    # ``dispatched``: a created ready item is stamped, as in the batch.
                    alone.append(
                        single.submit_in_transaction(request, lambda conn, item: None, dispatched=True)
                    )
                except DispatchError as exc:
                    alone.append(exc)
            assert [_answer(o) for o in together] == [_answer(o) for o in alone]
            assert _stored(batched) == _stored(single)
        finally:
            batched.close()
            single.close()
