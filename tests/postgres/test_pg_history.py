"""PostgreSQL fairness history: counters, the deferred prune, and acknowledgements that never wait on claims.

Acknowledgements only count a group's rows down; ``agent_dispatch_queue_prune`` removes the
history of groups and tenants left at zero. The invariant checked after every concurrent run: each
queued row has its tenant, group and lane rows (else it could never be claimed), each counter
equals its group's rows, each lane's ``ready`` equals its ready rows.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.postgres import PostgresTransport, _Claim
from agent_dispatch.transports.postgres import schema as _pg_schema

pytestmark = pytest.mark.postgres


@pytest.fixture
def queue(postgres_dsn: str) -> Iterator[PostgresTransport]:
    # No automatic prune: the tests call it.
    q = PostgresTransport(
        postgres_dsn,
        max_depth=1_000_000,
        visibility_timeout_s=300,
        history_prune_interval_s=0,
        pool_max_size=12,
    )
    q.ensure_ready()
    yield q
    q.close()


def turn(tenant: str, group: str = "", *, priority: int = 0, not_before: float | None = None) -> OutboundTurn:
    work_item_id = f"wi-{uuid.uuid4().hex}"
    return OutboundTurn(
        work_item_id,
        f"s-{work_item_id}",
        tenant,
        work_item_id.encode(),
        priority=priority,
        not_before=not_before,
        fairness_group=group or None,
    )


def rows(dsn: str, table: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # type: ignore[index]


def assert_consistent(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        orphans = conn.execute(
            """
            SELECT count(*) FROM agent_dispatch_queue q
             WHERE NOT EXISTS (SELECT 1 FROM agent_dispatch_queue_tenant t WHERE t.tenant_ref = q.tenant_ref)
                OR NOT EXISTS (SELECT 1 FROM agent_dispatch_queue_group g
                                WHERE g.tenant_ref = q.tenant_ref AND g.group_ref = q.group_ref)
                OR NOT EXISTS (SELECT 1 FROM agent_dispatch_queue_tenant_lane l
                                WHERE l.tenant_ref = q.tenant_ref AND l.priority = q.priority)
                OR NOT EXISTS (SELECT 1 FROM agent_dispatch_queue_group_lane l
                                WHERE l.tenant_ref = q.tenant_ref AND l.group_ref = q.group_ref
                                  AND l.priority = q.priority)
            """
        ).fetchone()
        assert orphans == (0,), "queued rows without their history can never be claimed"
        wrong_counts = conn.execute(
            """
            SELECT count(*) FROM agent_dispatch_queue_count c
              FULL JOIN (SELECT tenant_ref, group_ref, count(*) AS n FROM agent_dispatch_queue GROUP BY 1, 2) a
                ON a.tenant_ref = c.tenant_ref AND a.group_ref = c.group_ref
             WHERE coalesce(c.queued, -1) <> coalesce(a.n, 0)
            """
        ).fetchone()
        assert wrong_counts == (0,)
        wrong_ready = conn.execute(
            """
            SELECT count(*) FROM agent_dispatch_queue_group_lane l
             WHERE l.ready <> (SELECT count(*) FROM agent_dispatch_queue q
                                WHERE q.tenant_ref = l.tenant_ref AND q.group_ref = l.group_ref
                                  AND q.priority = l.priority AND q.state = 'r')
            """
        ).fetchone()
        assert wrong_ready == (0,)
        depth = conn.execute("SELECT depth FROM agent_dispatch_queue_depth").fetchone()
        assert depth == conn.execute("SELECT count(*) FROM agent_dispatch_queue").fetchone()


def test_the_prune_keeps_history_that_queued_rows_need(queue: PostgresTransport, postgres_dsn: str) -> None:
    queue.admit([turn("x", "g1"), turn("x", "g2"), turn("x", "g3", not_before=time.time() + 3600)])
    got = {d.work_item_id: d for d in queue.claim("w", max_items=2)}
    assert len(got) == 2
    first, second = got.values()
    queue.ack(first.receipt)
    # g1 or g2 is empty now; the other is claimed, g3 delayed: only the empty group goes.
    assert queue.prune_history() == 1
    assert rows(postgres_dsn, "agent_dispatch_queue_group") == 2
    assert rows(postgres_dsn, "agent_dispatch_queue_tenant") == 1
    assert_consistent(postgres_dsn)
    queue.ack(second.receipt)
    assert queue.prune_history() == 1
    assert rows(postgres_dsn, "agent_dispatch_queue_tenant") == 1  # the delayed row keeps x
    assert_consistent(postgres_dsn)


def test_a_tenant_back_before_the_prune_keeps_its_place(queue: PostgresTransport, postgres_dsn: str) -> None:
    # x is served and runs dry; y arrives; x gets work again before any prune.
    queue.admit([turn("x")])
    (d,) = queue.claim("w")
    queue.ack(d.receipt)
    y, x = turn("y"), turn("x")
    queue.admit([y])
    queue.admit([x])
    # x was served, y never: y first, though x's new turn would tie as a newcomer had x been pruned.
    assert [d.work_item_id for d in queue.claim("w", max_items=2)] == [y.work_item_id, x.work_item_id]
    assert_consistent(postgres_dsn)


def test_an_ack_does_not_wait_for_a_claim_holding_its_tenant(
    queue: PostgresTransport, postgres_dsn: str
) -> None:
    queue.admit([turn("x"), turn("x")])
    (delivery,) = queue.claim("w")
    with psycopg.connect(postgres_dsn) as holder:
        # What a long claim of x holds: x's history row, locked.
        holder.execute("SELECT 1 FROM agent_dispatch_queue_tenant FOR UPDATE")
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '2s'")
            started = time.monotonic()
            acked = conn.execute(
                "SELECT agent_dispatch_queue_ack(%s::bigint[], %s::text[], %s::uuid[], %s::timestamptz[])",
                _receipt_arrays(delivery.receipt.owner, delivery.receipt.token),
            ).fetchall()
            assert len(acked) == 1
            assert time.monotonic() - started < 1.0
        holder.rollback()
    assert queue.depth() == 1
    assert_consistent(postgres_dsn)


def _receipt_arrays(owner: str, token: str) -> tuple[list[int], list[str], list[uuid.UUID], list[object]]:
    claim = _Claim.decode(token)
    assert claim is not None
    return [claim.row_id], [owner], [claim.token], [claim.claimed_at]


def test_prunes_racing_admissions_claims_and_acks_lose_nothing(
    queue: PostgresTransport, postgres_dsn: str
) -> None:
    """Tenants run dry and refill all the time while the prune runs flat out."""
    tenants = [f"t{i}" for i in range(4)]
    groups = ["", "g"]
    stop = threading.Event()
    admitted: list[str] = []
    claimed: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def guard(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the test
                errors.append(exc)
                stop.set()

        return run

    @guard
    def admitter() -> None:
        n = 0
        while not stop.is_set():
            batch = [turn(tenants[(n + i) % 4], groups[(n + i) % 2]) for i in range(1 + n % 3)]
            queue.admit(batch)
            with lock:
                admitted.extend(t.work_item_id for t in batch)
            n += 1
            time.sleep(0.002 * (n % 3))  # slower than the workers: tenants keep running dry

    @guard
    def worker() -> None:
        while not stop.is_set():
            got = queue.claim(f"w-{threading.get_ident()}", max_items=3)
            assert not queue.ack_many([d.receipt for d in got])
            with lock:
                claimed.extend(d.work_item_id for d in got)

    pruned = [0]

    @guard
    def pruner() -> None:
        while not stop.is_set():
            removed = queue.prune_history()
            with lock:
                pruned[0] += removed

    threads = [threading.Thread(target=f) for f in (admitter, admitter, worker, worker, pruner, pruner)]
    for t in threads:
        t.start()
    time.sleep(6)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert pruned[0] > 10, f"the prune never raced anything ({pruned[0]} groups pruned)"
    assert_consistent(postgres_dsn)
    # Whatever is left is claimable: nothing was orphaned by a prune.
    while got := queue.claim("drain", max_items=50):
        claimed += [d.work_item_id for d in got]
        assert not queue.ack_many([d.receipt for d in got])
    assert sorted(claimed) == sorted(admitted)
    assert len(set(claimed)) == len(claimed)
    assert queue.depth() == 0
    queue.prune_history()
    assert {rows(postgres_dsn, t) for t in _pg_schema.HISTORY_TABLES} == {0}


def test_a_claiming_transport_prunes_and_vacuums_in_the_background(postgres_dsn: str) -> None:
    q = PostgresTransport(
        postgres_dsn,
        max_depth=1000,
        visibility_timeout_s=300,
        history_prune_interval_s=0.2,
        vacuum_interval_s=0.2,
    )
    q.ensure_ready()
    try:
        q.admit([turn("x", "g1"), turn("y")])
        for delivery in q.claim("w", max_items=2):
            q.ack(delivery.receipt)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and rows(postgres_dsn, "agent_dispatch_queue_tenant"):
            time.sleep(0.1)
        assert {rows(postgres_dsn, t) for t in _pg_schema.HISTORY_TABLES} == {0}
    finally:
        q.close()


def test_vacuum_takes_the_tables_with_dead_rows(queue: PostgresTransport, postgres_dsn: str) -> None:
    queue.admit([turn(f"t{i % 5}") for i in range(50)])
    while got := queue.claim("w", max_items=10):
        assert not queue.ack_many([d.receipt for d in got])
    # Dead rows reach the statistics within about a second of each backend's last transaction.
    deadline = time.monotonic() + 15
    vacuumed: list[str] = []
    while time.monotonic() < deadline and "agent_dispatch_queue" not in vacuumed:
        time.sleep(0.3)
        vacuumed = queue.vacuum(min_dead_small=1, min_dead_queue=1)
    assert {"agent_dispatch_queue", "agent_dispatch_queue_tenant_lane"} <= set(vacuumed)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        assert conn.execute(
            "SELECT vacuum_count + autovacuum_count > 0 FROM pg_stat_user_tables WHERE relname = 'agent_dispatch_queue'"
        ).fetchone() == (True,)
    assert queue.vacuum() == []  # nothing near the default thresholds
