"""The one-turn admission function against the batch one: the same turns, admitted one at a time
and as batches, must leave the same queue and the same fairness bookkeeping.

``agent_dispatch_queue_admit_one`` repeats the batch function's seven statements for scalars
(queue.sql says why); this keeps the two from drifting apart. What may differ is only what the
specification leaves open: newcomers that arrive in one batch are stamped in reference order, one
at a time in arrival order, so the stamps' values are compared for what they must be (a newcomer's
stamp, the same in the lanes as on the tenant or group), never with each other.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch.errors import DepthUnavailable, QueueFull
from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.postgres import PostgresTransport
from tests.postgres._queue import reset_queue

pytestmark = pytest.mark.postgres

#: Serve stamps below this are newcomers' (queue.sql: ``c_new_base`` plus a sequence number).
NEWCOMER_BELOW = -(2**61)


@pytest.fixture
def queue(postgres_dsn: str) -> Iterator[PostgresTransport]:
    q = PostgresTransport(
        postgres_dsn, max_depth=1_000_000, visibility_timeout_s=300, history_prune_interval_s=0
    )
    q.ensure_ready()
    yield q
    q.close()


def state(dsn: str) -> dict[str, Any]:
    """Everything admission writes, with the serve stamps checked and then left out."""
    with psycopg.connect(dsn, autocommit=True) as conn:

        def rows(query: str) -> list[tuple[Any, ...]]:
            return sorted(conn.execute(query).fetchall())

        tenants = dict(rows("SELECT tenant_ref, served FROM agent_dispatch_queue_tenant"))
        groups = {
            (t, g): s
            for t, g, s in rows("SELECT tenant_ref, group_ref, served FROM agent_dispatch_queue_group")
        }
        assert all(s < NEWCOMER_BELOW for s in [*tenants.values(), *groups.values()]), "nothing was served"
        tenant_lanes = rows(
            "SELECT tenant_ref, priority, tenant_served, ready FROM agent_dispatch_queue_tenant_lane"
        )
        group_lanes = rows(
            "SELECT tenant_ref, group_ref, priority, group_served, ready FROM agent_dispatch_queue_group_lane"
        )
        assert all(tenants[t] == s for t, _, s, _ in tenant_lanes), "a tenant lane lost its tenant's stamp"
        assert all(groups[(t, g)] == s for t, g, _, s, _ in group_lanes), (
            "a group lane lost its group's stamp"
        )
        return {
            "queue": rows(
                "SELECT work_item_id, session_id, tenant_ref, group_ref, priority, deadline, state, deliveries, wire"
                " FROM agent_dispatch_queue"
            ),
            "tenants": sorted(tenants),
            "groups": sorted(groups),
            "tenant_lanes": [(t, p, r) for t, p, _, r in tenant_lanes],
            "group_lanes": [(t, g, p, r) for t, g, p, _, r in group_lanes],
            "counts": rows("SELECT tenant_ref, group_ref, queued FROM agent_dispatch_queue_count"),
            "depth": rows("SELECT depth FROM agent_dispatch_queue_depth"),
        }


turn_specs = st.tuples(
    st.integers(0, 5),  # which work item (a repeat of an id is a replay: never a second row)
    st.sampled_from(["acme", "globex", "initech"]),
    st.sampled_from(["", "red", "blue"]),
    st.integers(-1, 2),  # priority
    st.booleans(),  # delayed (not yet due)
    st.booleans(),  # has a deadline
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(turn_specs, min_size=1, max_size=12), cuts=st.lists(st.integers(1, 4), max_size=6))
def test_one_at_a_time_leaves_what_batches_leave(
    queue: PostgresTransport,
    postgres_dsn: str,
    specs: list[tuple[int, str, str, int, bool, bool]],
    cuts: list[int],
) -> None:
    run = uuid.uuid4().hex[:8]
    later = time.time() + 3600
    # A repeated item is a replay of its first turn (the enqueue path re-admits a WorkItem's own turn).
    first: dict[int, OutboundTurn] = {}
    for item, tenant, group, priority, delayed, with_deadline in specs:
        work_item_id = f"wi-{run}-{item}"
        first.setdefault(
            item,
            OutboundTurn(
                work_item_id,
                f"s-{work_item_id}",
                tenant,
                work_item_id.encode(),
                priority=priority,
                deadline=later + 60 if with_deadline else None,
                fairness_group=group or None,
                not_before=later if delayed else None,
            ),
        )
    turns = [first[spec[0]] for spec in specs]
    distinct = len(first)

    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        reset_queue(postgres_dsn)
        inserted_alone = sum(queue.admit_on(conn, [t]) for t in turns)
        alone = state(postgres_dsn)

        reset_queue(postgres_dsn)
        inserted_batched, start = 0, 0
        for size in [*cuts, len(turns)]:
            inserted_batched += queue.admit_on(conn, turns[start : start + size])
            start += size
        batched = state(postgres_dsn)

    assert inserted_alone == inserted_batched == distinct
    assert alone == batched
    assert alone["depth"] == [(distinct,)]


def test_a_lone_turn_is_refused_at_the_bound_and_keeps_nothing(postgres_dsn: str) -> None:
    q = PostgresTransport(postgres_dsn, max_depth=1, visibility_timeout_s=300, history_prune_interval_s=0)
    q.ensure_ready()
    try:
        first = OutboundTurn("wi-1", "s-1", "acme", b"1")
        q.admit([first])
        before = state(postgres_dsn)
        with pytest.raises(QueueFull):
            q.admit([OutboundTurn("wi-2", "s-2", "globex", b"2", fairness_group="red")])
        assert state(postgres_dsn) == before, "a refused admission left bookkeeping behind"
        q.admit([first])  # a replay of what is queued is never refused, and adds nothing
        assert state(postgres_dsn) == before
        q.admit([OutboundTurn("wi-3", "s-3", "acme", b"3")], bounded=False)  # a re-drive passes the bound
        assert state(postgres_dsn)["depth"] == [(2,)]
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM agent_dispatch_queue_depth")
        with pytest.raises(DepthUnavailable):
            q.admit([OutboundTurn("wi-4", "s-4", "acme", b"4")])
    finally:
        q.close()
