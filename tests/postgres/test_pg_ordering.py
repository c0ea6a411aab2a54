"""PostgreSQL claim order, fairness and fairness-history pruning.

The claim order is specified as: expired deadlines first, priority (higher first), least
recently served tenant, least recently served fairness group, deadline, enqueue time, id. A
tenant or group with no serving history counts as least recently served; among several such,
the one that arrived first. The reference below is that sentence, written plainly in Python.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.postgres import PostgresTransport
from agent_dispatch.transports.postgres import schema as _pg_schema
from tests.postgres._queue import reset_queue

pytestmark = pytest.mark.postgres

NEVER_EXPIRES_S = 3600.0


@pytest.fixture
def transport(postgres_dsn: str) -> Iterator[PostgresTransport]:
    # A long visibility timeout: claimed rows stay invisible for the whole test.
    queue = PostgresTransport(postgres_dsn, max_depth=1_000_000, visibility_timeout_s=300)
    queue.ensure_ready()
    yield queue
    queue.close()


@dataclass(frozen=True)
class Row:
    idx: int
    tenant: str
    group: str
    priority: int
    deadline: float | None
    expired: bool
    work_item_id: str


class Reference:
    """The specified order as a plain simulation: pick the best row, stamp its tenant and group."""

    def __init__(self) -> None:
        self.tenant_stamp: dict[str, tuple[int, int]] = {}
        self.group_stamp: dict[tuple[str, str], tuple[int, int]] = {}
        self.clock = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def arrive(self, tenant: str, group: str) -> None:
        # (0, n): never served, in arrival order; (1, n): served, n = when. Tuples compare so.
        self.tenant_stamp.setdefault(tenant, (0, self._tick()))
        self.group_stamp.setdefault((tenant, group), (0, self._tick()))

    def serve(self, tenant: str, group: str) -> None:
        now = self._tick()
        self.tenant_stamp[tenant] = (1, now)
        self.group_stamp[(tenant, group)] = (1, now)

    def order(self, rows: list[Row]) -> list[str]:
        remaining = list(rows)
        out: list[str] = []
        while remaining:
            best = min(
                remaining,
                key=lambda r: (
                    not r.expired,
                    -r.priority,
                    self.tenant_stamp[r.tenant],
                    self.group_stamp[(r.tenant, r.group)],
                    math.inf if r.deadline is None else r.deadline,
                    r.idx,
                ),
            )
            remaining.remove(best)
            out.append(best.work_item_id)
            self.serve(best.tenant, best.group)
        return out


def outbound(tenant: str, group: str, *, priority: int = 0, deadline: float | None = None) -> OutboundTurn:
    work_item_id = f"wi-{uuid.uuid4().hex}"
    return OutboundTurn(
        work_item_id=work_item_id,
        session_id=f"s-{work_item_id}",
        tenant=tenant,
        wire=work_item_id.encode(),
        priority=priority,
        deadline=deadline,
        fairness_group=group or None,
    )


TENANTS = [f"tenant-{i}" for i in range(7)]
GROUPS = ["", "g1", "g2", "g3"]
row_specs = st.tuples(
    st.sampled_from(TENANTS),
    st.sampled_from(GROUPS),
    st.sampled_from([-5, 0, 0, 1, 7]),
    st.sampled_from(["none", "live", "expired"]),
    st.integers(0, 20),  # deadline offset: small, so equal deadlines happen too
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    history=st.lists(st.tuples(st.sampled_from(TENANTS), st.sampled_from(GROUPS)), max_size=8),
    specs=st.lists(row_specs, min_size=1, max_size=24),
    batch_sizes=st.lists(st.integers(1, 10), min_size=1, max_size=6),
)
def test_claim_order_matches_the_reference_sort(
    transport: PostgresTransport,
    postgres_dsn: str,
    history: list[tuple[str, str]],
    specs: list[tuple[str, str, int, str, int]],
    batch_sizes: list[int],
) -> None:
    reset_queue(postgres_dsn)
    reference = Reference()
    # Serving history through the public API: each history turn is the only claimable row when
    # it is claimed, and it stays claimed (unacknowledged) so its history is not pruned.
    for tenant, group in history:
        transport.admit([outbound(tenant, group)])
        reference.arrive(tenant, group)
        assert len(transport.claim("historian")) == 1
        reference.serve(tenant, group)

    now = time.time()
    rows: list[Row] = []
    for idx, (tenant, group, priority, kind, offset) in enumerate(specs):
        deadline = {"none": None, "live": now + NEVER_EXPIRES_S + offset, "expired": now - 100 - offset}[kind]
        sent = outbound(tenant, group, priority=priority, deadline=deadline)
        transport.admit([sent])  # one at a time: arrival order is admission order
        reference.arrive(tenant, group)
        rows.append(Row(idx, tenant, group, priority, deadline, kind == "expired", sent.work_item_id))
    expected = reference.order(rows)

    claimed: list[str] = []
    sizes = iter(batch_sizes * len(rows))
    while len(claimed) < len(rows):
        got = transport.claim("worker", max_items=next(sizes))
        assert got, f"claims stopped after {len(claimed)} of {len(rows)}"
        claimed += [d.work_item_id for d in got]
        # Acknowledge half of them: acks (and the pruning they trigger) must not disturb the order.
        transport.ack_many([d.receipt for d in got[::2]])
    assert claimed == expected
    assert transport.claim("worker") == []


def test_a_small_tenant_is_not_starved_by_a_large_one(transport: PostgresTransport) -> None:
    big = [outbound("tenant-a", "") for _ in range(10_000)]
    for start in range(0, len(big), 2_000):
        transport.admit(big[start : start + 2_000])
    # A has a serving history before B shows up.
    for delivery in transport.claim("worker", max_items=25):
        transport.ack(delivery.receipt)

    small = [outbound("tenant-b", "") for _ in range(10)]
    transport.admit(small)
    tenants_with_work = 2
    bound = 2 * tenants_with_work
    wanted = {t.work_item_id for t in small}
    positions: list[int] = []
    for position in range(1, 2 * tenants_with_work * len(small) + 1):
        (delivery,) = transport.claim("worker")
        transport.ack(delivery.receipt)
        if delivery.work_item_id in wanted:
            positions.append(position)
        if len(positions) == len(small):
            break
    assert len(positions) == len(small), f"only {len(positions)} of B's turns were claimed"
    assert positions[0] <= bound, positions
    gaps = [b - a for a, b in itertools.pairwise(positions)]
    assert max(gaps) <= bound, positions
    assert positions[-1] <= bound * len(small), positions


def history_rows(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            table: int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # type: ignore[index]
            for table in _pg_schema.HISTORY_TABLES
        }


def test_fairness_history_is_pruned_when_no_work_is_queued(
    transport: PostgresTransport, postgres_dsn: str
) -> None:
    transport.admit([outbound("tenant-x", "g1"), outbound("tenant-x", "g2"), outbound("tenant-y", "")])
    deliveries = {d.work_item_id: d for d in transport.claim("worker", max_items=3)}
    assert len(deliveries) == 3
    full = {
        "agent_dispatch_queue_tenant": 2,
        "agent_dispatch_queue_group": 3,
        "agent_dispatch_queue_tenant_lane": 2,
        "agent_dispatch_queue_group_lane": 3,
        "agent_dispatch_queue_count": 3,
    }
    assert history_rows(postgres_dsn) == full
    assert transport.prune_history() == 0  # every group still has a (claimed) row
    for delivery in deliveries.values():
        transport.ack(delivery.receipt)
    # The ack leaves the emptied history for the prune (it never waits on a claim's tenant lock).
    assert history_rows(postgres_dsn) == full
    assert transport.prune_history() == 3
    assert set(history_rows(postgres_dsn).values()) == {0}
    assert transport.depth() == 0


def test_scheduling_columns_hold_opaque_references(transport: PostgresTransport, postgres_dsn: str) -> None:
    transport.admit([outbound("acme-corp", "team-red")])
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        refs = conn.execute("SELECT tenant_ref, group_ref FROM agent_dispatch_queue").fetchall()
        history = conn.execute("SELECT tenant_ref FROM agent_dispatch_queue_tenant").fetchall()
    for value in [*refs[0], history[0][0]]:
        assert b"acme" not in bytes(value) and b"team" not in bytes(value)
        assert len(bytes(value)) == 16
    # Stable across processes sharing the database: a second transport derives the same refs.
    other = PostgresTransport(postgres_dsn, max_depth=10, visibility_timeout_s=10)
    try:
        assert other.tenant_ref("acme-corp") == bytes(refs[0][0])
    finally:
        other.close()


def claim_in_batches(
    transport: PostgresTransport,
    postgres_dsn: str,
    shapes: list[tuple[str, str, int]],
    *,
    max_items: int,
    acked: slice,
) -> tuple[list[str], list[str], list[int]]:
    """Admit one turn per (tenant, group, priority) shape, one at a time, then claim batches of
    ``max_items`` (acknowledging the ``acked`` part of each) until none is left: the reference
    order, the claimed order and the batch sizes."""
    reset_queue(postgres_dsn)
    reference = Reference()
    rows: list[Row] = []
    for idx, (tenant, group, priority) in enumerate(shapes):
        sent = outbound(tenant, group, priority=priority)
        transport.admit([sent])
        reference.arrive(tenant, group)
        rows.append(Row(idx, tenant, group, priority, None, False, sent.work_item_id))
    claimed: list[str] = []
    sizes: list[int] = []
    while got := transport.claim("worker", max_items=max_items):
        sizes.append(len(got))
        claimed += [d.work_item_id for d in got]
        transport.ack_many([d.receipt for d in got[acked]])
    return reference.order(rows), claimed, sizes


def test_batches_larger_than_the_tenant_count_follow_the_reference_order(
    transport: PostgresTransport, postgres_dsn: str
) -> None:
    """Claims of 16 over 30 tenants at two priorities: each call's first round is one statement."""
    shapes = [(f"tenant-{i * 7 % 30}", f"g{i % 3}", 1 if i % 5 == 0 else 0) for i in range(240)]
    expected, claimed, _ = claim_in_batches(
        transport, postgres_dsn, shapes, max_items=16, acked=slice(1, None, 2)
    )
    assert claimed == expected


def test_batches_larger_than_the_free_tenants_take_whole_rounds_in_the_reference_order(
    transport: PostgresTransport, postgres_dsn: str
) -> None:
    """Claims of 50 over 6 tenants, 3 groups and two priorities: a call takes several rounds, each
    one row of every tenant in lane order, and the result is still the reference order."""
    shapes = [(f"tenant-{i * 5 % 6}", f"g{i % 3}", 1 if i % 7 == 0 else 0) for i in range(300)]
    expected, claimed, sizes = claim_in_batches(
        transport, postgres_dsn, shapes, max_items=50, acked=slice(None, None, 3)
    )
    assert claimed == expected
    assert sizes[:5] == [50] * 5
