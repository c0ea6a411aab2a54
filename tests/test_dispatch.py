"""The enqueue path and the recovery re-drive, on real stores and real database transports.

Four layouts: the queue in the WorkItem store's own database (SQLite file, PostgreSQL database),
where submit and admit are one transaction, and the queue in a different database, where the
store's count of unfinished WorkItems is the bound (``dispatch.Counted``, as on Kafka): compared
and admitted in the submit's transaction, so a refusal keeps nothing there either.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agent_dispatch import dispatch
from agent_dispatch.envelope import open_envelope
from agent_dispatch.errors import (
    BackendUnavailable,
    DepthUnavailable,
    IdempotencyConflict,
    InvalidRequest,
    NotFound,
    QueueFull,
)
from agent_dispatch.models import SubmitRequest, SubmitResult, WorkState, deterministic_id
from agent_dispatch.settings import Settings
from agent_dispatch.store import WorkItemStore
from agent_dispatch.stores.postgres import PostgresStore
from agent_dispatch.stores.sqlite import SqliteStore
from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.postgres import PostgresTransport
from agent_dispatch.transports.sqlite import SqliteTransport

KEY = b"dispatch-test-signing-key-0123456789abcdef"


@dataclass
class Layout:
    name: str
    store: WorkItemStore
    transport: Any  # SqliteTransport | PostgresTransport
    settings: Settings
    shared: bool
    #: Make the transport's next depth probe fail for real.
    break_probe: Callable[[], None]
    #: Another store on the same database (leader-election checks).
    second_store: Callable[[], WorkItemStore]


LAYOUTS = [
    pytest.param("sqlite-shared", id="sqlite-shared"),
    pytest.param("sqlite-separate", id="sqlite-separate"),
    pytest.param("postgres-shared", id="postgres-shared", marks=pytest.mark.postgres),
    pytest.param("postgres-separate", id="postgres-separate", marks=pytest.mark.postgres),
]
#: The layouts where a failed admission can follow a kept submit (one transaction rolls both back).
SEPARATE_LAYOUTS = [p for p in LAYOUTS if "separate" in str(p.values[0])]


def _delete_depth_counter(dsn: str) -> Callable[[], None]:
    """The queue's depth cannot be read any more (its counter row is gone): never taken as zero.
    (Ending the pool's connections no longer breaks a probe: the pool replaces dead ones.)"""

    def run() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM agent_dispatch_queue_depth")

    return run


@pytest.fixture(params=LAYOUTS)
def make_layout(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Layout]]:
    kind: str = request.param
    closing: list[Any] = []

    def make(*, max_depth: int = 100) -> Layout:
        settings = Settings(max_depth=max_depth, signing_key=KEY.decode(), data_dir=tmp_path)
        store: WorkItemStore
        if kind.startswith("sqlite"):
            store_path = tmp_path / "agent-dispatch.sqlite3"
            queue_path = store_path if kind == "sqlite-shared" else tmp_path / "queue.sqlite3"
            store = SqliteStore(store_path, settings)
            transport: Any = SqliteTransport(queue_path, max_depth=max_depth, visibility_timeout_s=60)
            break_probe = transport.close

            def second() -> WorkItemStore:
                other = SqliteStore(store_path, settings)
                closing.append(other)
                return other
        else:
            store_dsn = request.getfixturevalue("postgres_dsn")
            if kind == "postgres-shared":
                queue_dsn = store_dsn
            else:
                server = request.getfixturevalue("postgres_server")
                queue_dsn = server.create_database(f"q_{uuid.uuid4().hex[:12]}")
            store = PostgresStore(store_dsn, settings)
            transport = PostgresTransport(queue_dsn, max_depth=max_depth, visibility_timeout_s=60)
            break_probe = _delete_depth_counter(queue_dsn)

            def second() -> WorkItemStore:
                other = PostgresStore(store_dsn, settings)
                closing.append(other)
                return other

        store.migrate()
        transport.ensure_ready()
        closing.extend([transport, store])
        return Layout(kind, store, transport, settings, kind.endswith("shared"), break_probe, second)

    yield make
    for thing in reversed(closing):
        thing.close()


def request_for(key: str, *, tenant: str = "tenant-a", **kwargs: Any) -> SubmitRequest:
    return SubmitRequest(
        tenant=tenant, kind="chat", payload=b'{"text":"hello"}', idempotency_key=key, **kwargs
    )


def enqueue(layout: Layout, request: SubmitRequest) -> SubmitResult:
    return dispatch.enqueue(
        layout.store, layout.transport, request, signing_key=KEY, settings=layout.settings
    )


def fill_queue_after_the_precheck(layout: Layout) -> None:
    """A concurrent submitter takes the last slot between our pre-check and our admission."""
    if layout.shared:
        real_depth = layout.transport.depth

        def depth() -> int:
            measured = real_depth()
            layout.transport.depth = real_depth  # once
            layout.transport.admit([OutboundTurn(f"other-{uuid.uuid4().hex}", "s", "tenant-b", b"{}")])
            return measured

        layout.transport.depth = depth
        return
    # The store's count is the bound: the other submitter goes through the store too.
    real_unfinished = layout.store.unfinished  # type: ignore[attr-defined]

    def unfinished() -> int:
        measured: int = real_unfinished()
        layout.store.unfinished = real_unfinished  # type: ignore[attr-defined]  # once
        assert enqueue(layout, request_for(f"other-{uuid.uuid4().hex}", tenant="tenant-b")).created
        return measured

    layout.store.unfinished = unfinished  # type: ignore[attr-defined]


def test_enqueue_admits_a_signed_envelope_of_the_item(make_layout: Callable[..., Layout]) -> None:
    layout = make_layout()
    result = enqueue(layout, request_for("k1", session_id="session-1", priority=3))
    assert result.created and result.item.state is WorkState.READY
    assert layout.transport.depth() == 1

    (delivery,) = layout.transport.claim("worker")
    envelope = open_envelope(delivery.wire, KEY)
    assert (envelope.job_id, envelope.payload_ref, envelope.tenant) == (result.item.id,) * 2 + ("tenant-a",)
    assert (envelope.session_id, envelope.kind, envelope.priority) == ("session-1", "chat", 3)
    assert delivery.work_item_id == result.item.id
    # Dispatch was recorded, so the recovery sweep does not re-drive a healthy item.
    assert layout.store.recoverable(stale_after_s=60) == []


def test_a_replayed_request_returns_the_item_without_a_second_delivery(
    make_layout: Callable[..., Layout],
) -> None:
    layout = make_layout()
    first = enqueue(layout, request_for("same-key"))
    again = enqueue(layout, request_for("same-key"))
    assert (again.created, again.item.id) == (False, first.item.id)
    assert layout.transport.depth() == 1


def test_admission_refused_after_submit(make_layout: Callable[..., Layout]) -> None:
    layout = make_layout(max_depth=1)
    fill_queue_after_the_precheck(layout)
    with pytest.raises(QueueFull):
        enqueue(layout, request_for("k-refused"))
    # One transaction (with the queue, or with the count): the refusal took the WorkItem with it.
    with pytest.raises(NotFound):
        layout.store.get(deterministic_id("tenant-a", "k-refused"))
    assert layout.transport.depth() == 1  # only the other submitter's turn


def test_a_replay_is_answered_while_the_queue_is_full_or_its_depth_unknown(
    make_layout: Callable[..., Layout],
) -> None:
    """The existing item answers a replay before admission does: no 429 or 503 for a turn that
    was accepted, and nothing admitted twice."""
    layout = make_layout(max_depth=1)
    first = enqueue(layout, request_for("k-accepted"))
    with pytest.raises(QueueFull):
        enqueue(layout, request_for("k-new"))
    again = enqueue(layout, request_for("k-accepted"))
    assert (again.created, again.item.id) == (False, first.item.id)
    # A replay that changes the request is still a conflict, full queue or not.
    with pytest.raises(IdempotencyConflict):
        enqueue(
            layout, SubmitRequest(tenant="tenant-a", kind="chat", payload=b"{}", idempotency_key="k-accepted")
        )
    batch = dispatch.enqueue_many(
        layout.store,
        layout.transport,
        [request_for("k-accepted"), request_for("k-new"), request_for("k-bad", session_id="has spaces")],
        signing_key=KEY,
        settings=layout.settings,
    )
    assert isinstance(batch[0], SubmitResult) and (batch[0].created, batch[0].item.id) == (
        False,
        first.item.id,
    )
    assert isinstance(batch[1], QueueFull) and isinstance(batch[2], InvalidRequest)

    def unknown() -> int:
        raise DepthUnavailable("probe failed")

    layout.transport.depth = unknown
    assert enqueue(layout, request_for("k-accepted")).item.id == first.item.id
    with pytest.raises(DepthUnavailable):
        enqueue(layout, request_for("k-new"))
    with pytest.raises(NotFound):
        layout.store.get(deterministic_id("tenant-a", "k-new"))
    del layout.transport.depth
    assert layout.transport.depth() == 1


@pytest.mark.parametrize("make_layout", SEPARATE_LAYOUTS, indirect=True)
def test_a_backend_failure_after_submit_leaves_the_item_for_the_sweep(
    make_layout: Callable[..., Layout],
) -> None:
    """Not a refusal: the outcome is unknown (the turn may be queued already). The WorkItem stays
    ready, the sweep re-drives it, and a retry with the same key returns it, never a cancelled one.
    Separate databases only: in one transaction a failed admission rolls the submit back."""
    layout = make_layout()
    real_admit = layout.transport.admit

    def broken(turns: Any, *, bounded: bool = True) -> None:
        raise BackendUnavailable("queue database went away")

    layout.transport.admit = broken
    with pytest.raises(BackendUnavailable):
        enqueue(layout, request_for("k-unknown"))
    item_id = deterministic_id("tenant-a", "k-unknown")
    assert layout.store.get(item_id).state is WorkState.READY
    # Stamped as dispatched by its insert: the sweep re-drives it once that stamp is stale.
    assert [i.id for i in layout.store.recoverable(stale_after_s=0)] == [item_id]
    retry = enqueue(layout, request_for("k-unknown"))
    assert (retry.created, retry.item.id, retry.item.state) == (False, item_id, WorkState.READY)
    layout.transport.admit = real_admit
    redriven = dispatch.redrive(
        layout.store, layout.transport, settings=layout.settings, signing_key=KEY, stale_after_s=0
    )
    assert redriven == 1
    (delivery,) = layout.transport.claim("worker")
    assert delivery.work_item_id == item_id


def test_a_failing_depth_probe_rejects_before_anything_is_stored(make_layout: Callable[..., Layout]) -> None:
    layout = make_layout()
    layout.break_probe()
    with pytest.raises(DepthUnavailable):
        enqueue(layout, request_for("k-probe"))
    with pytest.raises(
        NotFound
    ):  # a fresh store: breaking the probe may have hit the store's connections too
        layout.second_store().get(deterministic_id("tenant-a", "k-probe"))


def test_a_request_whose_envelope_cannot_be_sealed_is_refused_up_front(
    make_layout: Callable[..., Layout],
) -> None:
    layout = make_layout()
    with pytest.raises(InvalidRequest):
        enqueue(layout, request_for("k-bad", session_id="has spaces"))
    with pytest.raises(NotFound):
        layout.store.get(deterministic_id("tenant-a", "k-bad"))
    assert layout.transport.depth() == 0


def test_enqueue_many_accepts_what_fits_and_answers_each(make_layout: Callable[..., Layout]) -> None:
    layout = make_layout(max_depth=3)
    requests = [request_for(f"batch-{i}") for i in range(5)]
    requests.insert(2, request_for("batch-bad", session_id="has spaces"))
    outcomes = dispatch.enqueue_many(
        layout.store, layout.transport, requests, signing_key=KEY, settings=layout.settings
    )
    assert len(outcomes) == 6
    assert isinstance(outcomes[2], InvalidRequest)
    accepted = [o for o in outcomes if isinstance(o, SubmitResult)]
    refused = [o for o in outcomes if isinstance(o, QueueFull)]
    assert (len(accepted), len(refused)) == (3, 2)
    assert layout.transport.depth() == 3
    for request, outcome in zip(requests, outcomes, strict=True):
        if isinstance(outcome, QueueFull):
            with pytest.raises(NotFound):  # a refusal keeps nothing, in every layout
                layout.store.get(deterministic_id("tenant-a", request.idempotency_key or ""))


def test_redrive_readmits_undispatched_items_only_while_leading(make_layout: Callable[..., Layout]) -> None:
    layout = make_layout()
    # Submitted, but the process died before admitting it: nothing is queued.
    item = layout.store.submit(request_for("k-lost")).item
    assert layout.transport.depth() == 0

    other = layout.second_store()
    assert other.try_lead(dispatch.RECOVERY_LEADER)
    assert dispatch.redrive(layout.store, layout.transport, settings=layout.settings, signing_key=KEY) == 0
    other.close()

    sweep = dispatch.redrive(
        layout.store, layout.transport, settings=layout.settings, signing_key=KEY, stale_after_s=0
    )
    assert sweep == 1
    (delivery,) = layout.transport.claim("worker")
    assert open_envelope(delivery.wire, KEY).job_id == item.id
    # Dispatched now: the next sweep leaves it alone, and a forced one does not double the delivery.
    assert dispatch.redrive(layout.store, layout.transport, settings=layout.settings, signing_key=KEY) == 0
    dispatch.redrive(
        layout.store, layout.transport, settings=layout.settings, signing_key=KEY, stale_after_s=0
    )
    assert layout.transport.depth() == 1
