"""The ``Inspectable`` contract (the web UI's reads and the dead-letter retry), on every store."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch.errors import InvalidTransition, LeaseLost, NotFound, QueueFull
from agent_dispatch.models import Outcome, SubmitRequest, WorkItem, WorkState
from agent_dispatch.store import CountsUnfinished, Inspectable, WorkItemStore
from tests.contract._store_harness import (  # noqa: F401 (store_postgres_dsn is a fixture)
    BACKENDS,
    Harness,
    open_harness,
    store_postgres_dsn,
)

TTL = 60.0


@pytest.fixture(params=BACKENDS)
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    with open_harness(request.param, request, tmp_path) as harness:
        yield harness


def insp(h: Harness) -> Inspectable:
    assert isinstance(h.store, Inspectable)
    return h.store


def submit(store: WorkItemStore, tenant: str = "t1", **kw: object) -> WorkItem:
    request = SubmitRequest(tenant=tenant, kind=str(kw.pop("kind", "turn")), payload=b"{}", **kw)  # type: ignore[arg-type]
    return store.submit(request).item


def dead_lettered(h: Harness, tenant: str = "t1") -> tuple[WorkItem, object]:
    """An item whose one attempt failed: dead-lettered, with the lease that failed it."""
    item = submit(h.store, tenant, max_attempts=1)
    lease = h.store.claim("w1", work_item_id=item.id)
    assert lease is not None
    assert h.store.retry(lease, error="boom").state is WorkState.DEAD_LETTER
    return item, lease


def test_retry_dead_letter_makes_it_ready_with_one_more_attempt_and_a_fresh_fence(h: Harness) -> None:
    s, i = h.store, insp(h)
    item, old = dead_lettered(h)
    back = i.retry_dead_letter(item.id, tenant="t1", reason="retried from the UI")
    assert back.state is WorkState.READY
    assert (back.attempt, back.max_attempts) == (1, 2)
    assert back.outcome is None and back.error is None and back.lease_owner is None
    assert [r.event for r in s.outcomes(item.id)][-1] == "retry_dead_letter"
    assert s.outcomes(item.id)[-1].detail == "retried from the UI"
    # The dead lease stays dead: no fenced call of it is accepted any more.
    with pytest.raises(LeaseLost):
        s.commit(old, Outcome.SUCCEEDED)  # type: ignore[arg-type]
    # It is ready with the recovery sweep's attention, so it is never left undelivered.
    assert item.id in {r.id for r in s.recoverable(stale_after_s=0.0)}
    lease = s.claim("w2", work_item_id=item.id)
    assert lease is not None
    assert lease.lease_epoch > old.lease_epoch and lease.fencing_token > old.fencing_token  # type: ignore[attr-defined]
    assert lease.attempt == 2
    assert s.commit(lease, Outcome.SUCCEEDED).item.state is WorkState.SUCCEEDED


def test_retry_dead_letter_is_scoped_to_the_tenant_and_only_from_dead_letter(h: Harness) -> None:
    s, i = h.store, insp(h)
    item, _ = dead_lettered(h)
    with pytest.raises(NotFound):
        i.retry_dead_letter(item.id, tenant="t2", reason="x")
    with pytest.raises(NotFound):
        i.retry_dead_letter("no-such-item", tenant=None, reason="x")
    assert s.get(item.id).state is WorkState.DEAD_LETTER
    assert i.retry_dead_letter(item.id, tenant=None, reason="admin").state is WorkState.READY
    with pytest.raises(InvalidTransition):
        i.retry_dead_letter(item.id, tenant="t1", reason="again")  # ready now, not dead_letter
    done = submit(s)
    lease = s.claim("w", work_item_id=done.id)
    assert lease is not None
    s.commit(lease, Outcome.SUCCEEDED)
    with pytest.raises(InvalidTransition):
        i.retry_dead_letter(done.id, tenant="t1", reason="x")


def test_retry_dead_letter_of_a_waiting_item_waits_again_for_its_dependency(h: Harness) -> None:
    s, i = h.store, insp(h)
    parent = submit(s, "t1")
    child = submit(s, "t1", depends_on=(parent.id,))
    assert s.get(child.id).state is WorkState.SUBMITTED
    s.dead_letter(child.id, reason="poison envelope")
    back = i.retry_dead_letter(child.id, tenant="t1", reason="x")
    assert back.state is WorkState.SUBMITTED  # still waiting on its dependency, not ready
    assert child.id not in {r.id for r in s.recoverable(stale_after_s=0.0)}
    with pytest.raises(InvalidTransition, match="waiting"):
        s.claim("w", work_item_id=child.id)
    # The dependency's success releases it exactly as if it had never been dead-lettered.
    lease = s.claim("w", work_item_id=parent.id)
    assert lease is not None
    s.commit(lease, Outcome.SUCCEEDED)
    assert s.get(child.id).state is WorkState.READY


def test_retry_dead_letter_after_its_dependency_succeeded_is_ready(h: Harness) -> None:
    s, i = h.store, insp(h)
    parent = submit(s, "t1")
    child = submit(s, "t1", depends_on=(parent.id,))
    s.dead_letter(child.id, reason="poison envelope")
    lease = s.claim("w", work_item_id=parent.id)
    assert lease is not None
    s.commit(lease, Outcome.SUCCEEDED)  # its release skips the dead-lettered child
    assert i.retry_dead_letter(child.id, tenant="t1", reason="x").state is WorkState.READY


def test_retry_dead_letter_refuses_while_a_dependency_can_no_longer_succeed(h: Harness) -> None:
    s, i = h.store, insp(h)
    parent, _ = dead_lettered(h)
    child = submit(s, "t1", depends_on=(parent.id,))  # cancelled at once: its dependency is dead
    other = submit(s, "t1")
    waiting = submit(s, "t1", depends_on=(other.id,))
    s.dead_letter(waiting.id, reason="x")
    s.dead_letter(other.id, reason="x")
    with pytest.raises(InvalidTransition, match=other.id):
        i.retry_dead_letter(waiting.id, tenant="t1", reason="x")
    assert s.get(waiting.id).state is WorkState.DEAD_LETTER
    # Retrying the dependency first, then the dependent: it waits for the dependency again.
    i.retry_dead_letter(other.id, tenant="t1", reason="x")
    assert i.retry_dead_letter(waiting.id, tenant="t1", reason="x").state is WorkState.SUBMITTED
    assert s.get(child.id).state is WorkState.CANCELLED


# --- the retry under the admission bound -------------------------------------------------------------------


def everything(store: WorkItemStore) -> list[WorkItem]:
    return [item for t in ("t1", "t2") for item in store.list_items(tenant=t, limit=1000)]


def unfinished(store: WorkItemStore) -> int:
    """The unfinished items, read back one by one; a store's O(1) count must agree."""
    n = sum(not item.state.terminal for item in everything(store))
    if isinstance(store, CountsUnfinished):
        assert store.unfinished() == n
    return n


def test_retry_dead_letter_at_the_bound_is_refused_until_there_is_room(h: Harness) -> None:
    s, i = h.store, insp(h)
    item, _ = dead_lettered(h)
    first = submit(s, "t1")
    submit(s, "t2")
    before = everything(s), s.outcomes(item.id)
    for bound in (1, 2):  # past the bound, and at it: the retried item would take it past
        with pytest.raises(QueueFull):
            i.retry_dead_letter(item.id, tenant="t1", reason="x", bound=bound)
    assert (everything(s), s.outcomes(item.id)) == before  # still dead-lettered, nothing recorded
    assert unfinished(s) == 2
    # Room comes back when an item finishes; the unbounded retry (no ``bound``) never asks.
    lease = s.claim("w", work_item_id=first.id)
    assert lease is not None
    s.commit(lease, Outcome.SUCCEEDED)
    assert i.retry_dead_letter(item.id, tenant="t1", reason="x", bound=2).state is WorkState.READY
    assert unfinished(s) == 2


@st.composite
def bounded_retries(draw: st.DrawFn) -> tuple[int, int, int, bool]:
    """(finished items, other unfinished items, the bound, whether the retried item waits on one)."""
    waits = draw(st.booleans())
    others = draw(st.integers(1 if waits else 0, 4))
    return draw(st.integers(0, 2)), others, max(1, others + draw(st.integers(-2, 2))), waits


_cases = (f"bound{n}" for n in itertools.count())


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=bounded_retries())
def test_a_bounded_retry_is_refused_exactly_when_the_unfinished_items_are_at_the_bound(
    backend: str, case: tuple[int, int, int, bool], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Refused (``QueueFull``, nothing changed) iff the unfinished items number ``bound`` or more;
    else the item is back (ready, or waiting on its dependency) and counted: one more."""
    finished, others, bound, waits = case
    case_dir = tmp_path / next(_cases)
    case_dir.mkdir()
    with open_harness(backend, request, case_dir) as h:
        s, i = h.store, insp(h)
        for _ in range(finished):  # terminal items take no room
            lease = s.claim("w", work_item_id=submit(s, "t2").id)
            assert lease is not None
            s.commit(lease, Outcome.SUCCEEDED)
        parent = submit(s, "t1") if waits else None
        target = submit(s, "t1", depends_on=(parent.id,) if parent else ())
        s.dead_letter(target.id, reason="poison envelope")
        for _ in range(others - waits):
            submit(s, "t2")
        assert unfinished(s) == others
        before = everything(s), s.outcomes(target.id)
        if others >= bound:
            with pytest.raises(QueueFull):
                i.retry_dead_letter(target.id, tenant="t1", reason="x", bound=bound)
            assert (everything(s), s.outcomes(target.id)) == before
            assert unfinished(s) == others
        else:
            back = i.retry_dead_letter(target.id, tenant="t1", reason="x", bound=bound)
            assert back.state is (WorkState.SUBMITTED if waits else WorkState.READY)
            assert unfinished(s) == others + 1


def test_browse_filters_pages_and_scopes_by_tenant(h: Harness) -> None:
    s, i = h.store, insp(h)
    a = [submit(s, "t1", kind="alpha", session_id="s1") for _ in range(3)]
    b = submit(s, "t1", kind="beta", session_id="s2")
    other = submit(s, "t2", kind="alpha")
    assert [x.id for x in i.browse(tenant="t1")] == [b.id, *reversed([x.id for x in a])]
    assert [x.id for x in i.browse(tenant="t1", kind="alpha")] == [x.id for x in reversed(a)]
    assert [x.id for x in i.browse(tenant="t1", session_id="s2")] == [b.id]
    assert [x.id for x in i.browse(tenant=None, kind="alpha", limit=2)] == [other.id, a[2].id]
    page = i.browse(tenant="t1", limit=2)
    rest = i.browse(tenant="t1", limit=2, after=page[-1].id)
    assert [x.id for x in page + rest] == [x.id for x in i.browse(tenant="t1")]
    assert i.browse(tenant="t1", after=other.id) == []  # another tenant's id as a cursor: nothing
    lease = s.claim("w", work_item_id=b.id)
    assert lease is not None
    assert [x.id for x in i.browse(tenant="t1", states=[WorkState.LEASED])] == [b.id]


def test_dependents_tenant_stats_held_leases_and_events(h: Harness) -> None:
    s, i = h.store, insp(h)
    start = i.events_after(-1)
    first = start[0].seq if start else 0
    parent = submit(s, "t1")
    child = submit(s, "t1", depends_on=(parent.id,))
    submit(s, "t2")
    assert i.dependents(parent.id) == [child.id]
    assert i.dependents(child.id) == []
    lease = s.claim("w9", work_item_id=parent.id)
    assert lease is not None
    stats = {t.tenant: t for t in i.tenant_stats()}
    assert (stats["t1"].queued, stats["t1"].running) == (1, 1)  # the child waits, the parent runs
    assert (stats["t2"].queued, stats["t2"].running) == (1, 0)
    assert stats["t2"].oldest_waiting is not None
    held = i.held_leases()
    assert [(x.id, x.lease_owner) for x in held] == [(parent.id, "w9")]
    seen = i.events_after(first)
    assert [e.record.event for e in seen] == ["submit", "submit", "submit", "claim"]
    assert [e.seq for e in seen] == sorted(e.seq for e in seen)
    assert i.events_after(seen[1].seq, limit=1)[0].seq == seen[2].seq
    assert i.events_after(-1)[0].seq == seen[-1].seq
    s.commit(lease, Outcome.SUCCEEDED)
    assert {t.tenant: t.queued for t in i.tenant_stats()}["t1"] == 1  # the child is ready now
    assert i.held_leases() == []


def pages(h: Harness) -> Inspectable:
    return insp(h)


def stats_of(h: Harness, **kw: Any) -> dict[str, tuple[int, int, int]]:
    return {t.tenant: (t.queued, t.running, t.done) for t in pages(h).tenant_stats(**kw)}


def test_tenant_stats_count_each_transition_and_page_in_name_order(h: Harness) -> None:
    s, p = h.store, pages(h)
    assert p.tenant_stats() == []
    parent = submit(s, "t1")
    child = submit(s, "t1", depends_on=(parent.id,))
    for tenant in ("t2", "t3", "t3"):
        submit(s, tenant)
    assert stats_of(h) == {"t1": (2, 0, 0), "t2": (1, 0, 0), "t3": (2, 0, 0)}
    lease = s.claim("w", work_item_id=parent.id)
    assert lease is not None
    assert stats_of(h)["t1"] == (1, 1, 0)
    lease = s.mark_running(lease)
    assert stats_of(h)["t1"] == (1, 1, 0)  # leased -> running stays "running"
    p.fold_tenant_counts()
    s.commit(lease, Outcome.SUCCEEDED)
    assert stats_of(h)["t1"] == (1, 0, 1)  # the child is ready now: still queued
    s.cancel(child.id, tenant="t1", reason="x")
    assert stats_of(h)["t1"] == (0, 0, 2)
    p.fold_tenant_counts()
    p.fold_tenant_counts()  # folding twice changes nothing
    assert stats_of(h) == {"t1": (0, 0, 2), "t2": (1, 0, 0), "t3": (2, 0, 0)}
    first = p.tenant_stats(limit=2)
    assert [t.tenant for t in first] == ["t1", "t2"]
    assert [t.tenant for t in p.tenant_stats(after="t2", limit=2)] == ["t3"]
    assert p.tenant_stats(after="t3") == []
    assert [t.tenant for t in p.tenant_stats(tenants=["t3", "nobody"])] == ["t3"]
    t1 = p.tenant_stats(tenants=["t1"])[0]
    assert t1.oldest_waiting is None and t1.last_served is not None
    t3 = p.tenant_stats(tenants=["t3"])[0]
    assert t3.oldest_waiting is not None and t3.last_served is None


def test_tenant_stats_follow_retries_dead_letters_and_expiry(h: Harness) -> None:
    s, i = h.store, insp(h)
    item, _ = dead_lettered(h)
    assert stats_of(h)["t1"] == (0, 0, 1)
    i.retry_dead_letter(item.id, tenant="t1", reason="x")
    assert stats_of(h)["t1"] == (1, 0, 0)
    again = submit(s, "t1", max_attempts=2)
    lease = s.claim("w", work_item_id=again.id)
    assert lease is not None
    assert stats_of(h)["t1"] == (1, 1, 0)
    s.retry(lease, error="once more")  # back to ready: queued again
    assert stats_of(h)["t1"] == (2, 0, 0)


@pytest.mark.parametrize("backend", [pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_tenants_page_reads_the_counters_not_the_items(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """PostgreSQL: a page costs its tenants (the counters' rows, one index probe each for the
    oldest waiting item), not their items; the GROUP BY it replaced read every unfinished row."""
    import psycopg

    from agent_dispatch.stores.postgres import _inspect as pgi

    with open_harness(backend, request, tmp_path) as h:
        store = h.store
        requests = [SubmitRequest(tenant=f"t{i % 3}", kind="turn", payload=b"p") for i in range(3000)]
        store.submit_many_in_transaction(requests, lambda conn, items: None)  # type: ignore[attr-defined]
        pages(h).fold_tenant_counts()
        assert stats_of(h) == {"t0": (1000, 0, 0), "t1": (1000, 0, 0), "t2": (1000, 0, 0)}
        dsn = request.getfixturevalue("store_postgres_dsn")
        with psycopg.connect(dsn) as conn:
            assert _items_read(conn, pgi.TENANT_NAMES, {"after": "", "limit": 50}) == 0
            assert _items_read(conn, pgi.TENANT_STATS, {"tenants": ["t0", "t1", "t2"]}) <= 3
            assert _items_read(conn, GROUPED_BACKLOG, {}) >= 3000  # what the page did before


#: The tenants page's read before the counters: a GROUP BY over every unfinished item.
GROUPED_BACKLOG = (
    "SELECT tenant, count(*) FROM agent_dispatch_work_items"
    " WHERE state IN ('submitted', 'ready', 'leased', 'running') GROUP BY tenant"
)


def _items_read(conn: Any, statement: str, params: dict[str, Any]) -> int:
    """Rows the WorkItem table gave ``statement`` (returned by scans plus fetched through indexes),
    counted in the statement's own transaction."""
    with conn.transaction(force_rollback=True):
        conn.execute(statement, params).fetchall()
        row = conn.execute(
            "SELECT pg_stat_get_xact_tuples_returned(c.oid) + pg_stat_get_xact_tuples_fetched(c.oid)"
            " FROM pg_class c WHERE c.relname = 'agent_dispatch_work_items'"
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("backend", [pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_retry_waits_for_a_dependency_that_is_committing(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """PostgreSQL: the retry locks the dependencies it reads. A dependency whose commit is in
    flight (its release already skipped the dead-lettered dependent) is waited for and then seen
    succeeded, so the dependent goes to ready; read without the lock it would wait for a release
    that already happened, forever."""
    import threading

    import psycopg

    with open_harness(backend, request, tmp_path) as h:
        s, i = h.store, insp(h)
        parent = submit(s, "t1")
        child = submit(s, "t1", depends_on=(parent.id,))
        s.dead_letter(child.id, reason="poison envelope")
        dsn = request.getfixturevalue("store_postgres_dsn")
        with psycopg.connect(dsn) as committing:
            # A worker's commit of the parent, between its update and its COMMIT.
            committing.execute(
                "UPDATE agent_dispatch_work_items SET state = 'succeeded', outcome = 'succeeded' WHERE id = %s",
                (parent.id,),
            )
            result: list[WorkItem] = []
            retry = threading.Thread(
                target=lambda: result.append(i.retry_dead_letter(child.id, tenant="t1", reason="x"))
            )
            retry.start()
            retry.join(timeout=1.0)
            assert retry.is_alive(), "the retry read the dependency without waiting for its commit"
            committing.commit()
        retry.join(timeout=10)
        assert result and result[0].state is WorkState.READY
