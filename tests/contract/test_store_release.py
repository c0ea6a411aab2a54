"""The dependents a commit releases: reported by every store (``CommitResult.released``), and
handed to a caller's step inside the commit's transaction by the SQL stores
(:class:`agent_dispatch.store.TransactionalCommit`), on memory, SQLite and a real PostgreSQL."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch.models import Lease, Outcome, SubmitRequest, WorkItem, WorkState
from agent_dispatch.store import TransactionalCommit, WorkItemStore
from tests.contract._store_harness import (  # noqa: F401 (store_postgres_dsn is a fixture)
    BACKENDS,
    DB_BACKENDS,
    Harness,
    open_harness,
    store_postgres_dsn,
)

STALE_S = 3600.0  # "not dispatched for an hour": only never-dispatched items are that stale


@pytest.fixture(params=BACKENDS)
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    with open_harness(request.param, request, tmp_path) as harness:
        yield harness


@pytest.fixture(params=DB_BACKENDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    with open_harness(request.param, request, tmp_path) as harness:
        yield harness


def submit(store: WorkItemStore, *depends_on: str) -> WorkItem:
    return store.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"{}", depends_on=depends_on)).item


def lease_of(store: WorkItemStore, item: WorkItem) -> Lease:
    lease = store.claim("w1", work_item_id=item.id)
    assert lease is not None
    return lease


def never_dispatched(store: WorkItemStore) -> set[str]:
    return {item.id for item in store.recoverable(stale_after_s=STALE_S)}


def test_a_commit_reports_exactly_the_dependents_it_made_ready(h: Harness) -> None:
    s = h.store
    a, other = submit(s), submit(s)
    only_a = submit(s, a.id)
    both = submit(s, a.id, other.id)
    grandchild = submit(s, only_a.id)
    lease = lease_of(s, a)
    result = s.commit(lease, Outcome.SUCCEEDED)
    assert [item.id for item in result.released] == [only_a.id]
    assert result.released[0].state is WorkState.READY
    assert s.get(both.id).state is WorkState.SUBMITTED
    assert s.get(grandchild.id).state is WorkState.SUBMITTED
    # A repeated commit releases nothing again.
    again = s.commit(lease, Outcome.SUCCEEDED)
    assert again.repeated and again.released == ()
    assert [i.id for i in s.commit(lease_of(s, other), Outcome.SUCCEEDED).released] == [both.id]


@pytest.mark.parametrize("outcome", [Outcome.FAILED, Outcome.CANCELLED])
def test_a_commit_that_cancels_its_dependents_releases_none(h: Harness, outcome: Outcome) -> None:
    s = h.store
    a = submit(s)
    child = submit(s, a.id)
    assert s.commit(lease_of(s, a), outcome).released == ()
    assert s.get(child.id).state is WorkState.CANCELLED


def test_a_commit_without_dependents_releases_none(h: Harness) -> None:
    s = h.store
    assert s.commit(lease_of(s, submit(s)), Outcome.SUCCEEDED).released == ()
    assert s.commit_many([(lease_of(s, submit(s)), Outcome.SUCCEEDED, None)])


def _capable(store: WorkItemStore) -> TransactionalCommit:
    assert isinstance(store, TransactionalCommit)
    return store


def _update_priority(h: Harness, conn: Any, item_id: str) -> None:
    """A write on the commit's own connection, in the dialect of the harness's database."""
    mark = "?" if h.backend == "sqlite" else "%s"
    conn.execute(f"UPDATE agent_dispatch_work_items SET priority = 7 WHERE id = {mark}", (item_id,))


def test_commit_in_transaction_runs_the_step_in_the_commit_and_stamps_the_dispatch(db: Harness) -> None:
    s = db.store
    a = submit(s)
    child = submit(s, a.id)
    seen: list[list[str]] = []

    def step(conn: Any, released: list[WorkItem]) -> None:
        seen.append([item.id for item in released])
        _update_priority(db, conn, child.id)  # on the commit's connection, in its transaction

    result = _capable(s).commit_in_transaction(lease_of(s, a), Outcome.SUCCEEDED, step)
    assert seen == [[child.id]]
    assert [item.id for item in result.released] == [child.id]
    assert s.get(a.id).state is WorkState.SUCCEEDED
    got = s.get(child.id)
    assert got.state is WorkState.READY and got.priority == 7
    assert child.id not in never_dispatched(s)  # stamped in the same transaction


def test_a_failing_step_is_undone_alone_and_the_commit_stands(db: Harness) -> None:
    s = db.store
    a = submit(s)
    child = submit(s, a.id)

    def step(conn: Any, released: list[WorkItem]) -> None:
        _update_priority(db, conn, child.id)
        raise RuntimeError("the queue refused")

    result = _capable(s).commit_in_transaction(lease_of(s, a), Outcome.SUCCEEDED, step)
    assert [item.id for item in result.released] == [child.id]
    assert s.get(a.id).state is WorkState.SUCCEEDED
    got = s.get(child.id)
    assert got.state is WorkState.READY and got.priority == 0  # the step's write was undone
    assert child.id in never_dispatched(s)  # left for the sweep, first in line


def test_commit_in_transaction_calls_no_step_when_nothing_is_released(db: Harness) -> None:
    s = db.store
    a, b = submit(s), submit(s)
    waiting = submit(s, a.id, b.id)
    calls: list[Any] = []
    cap = _capable(s)
    assert (
        cap.commit_in_transaction(lease_of(s, a), Outcome.SUCCEEDED, lambda *x: calls.append(x)).released
        == ()
    )
    assert (
        cap.commit_in_transaction(lease_of(s, b), Outcome.FAILED, lambda *x: calls.append(x)).released == ()
    )
    assert calls == []
    assert s.get(waiting.id).state is WorkState.CANCELLED


# --- property: every dependent is released exactly once, by its last dependency's commit ----------------


@st.composite
def dags(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], list[int]]:
    """Dependencies of up to 7 items (each on earlier ones) and an order to finish them in."""
    size = draw(st.integers(2, 7))
    deps = [tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=3)))) if i else () for i in range(size)]
    return deps, draw(st.permutations(range(size)))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=dags())
def test_each_dependent_is_released_once_by_the_commit_of_its_last_dependency(
    backend: str,
    case: tuple[list[tuple[int, ...]], list[int]],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    deps, order = case
    case_dir = tmp_path / next(_names)
    case_dir.mkdir()
    with open_harness(backend, request, case_dir) as harness:
        s = harness.store
        items: list[WorkItem] = []
        for needs in deps:
            items.append(submit(s, *(items[d].id for d in needs)))
        done: list[int] = []
        released_by: dict[int, int] = {}
        index = {item.id: i for i, item in enumerate(items)}
        pending = list(order)
        while pending:
            # Finish the first item in the drawn order whose dependencies have all succeeded.
            i = next(i for i in pending if set(deps[i]) <= set(done))
            pending.remove(i)
            result = s.commit(lease_of(s, items[i]), Outcome.SUCCEEDED)
            done.append(i)
            for item in result.released:
                assert index[item.id] not in released_by, "released twice"
                released_by[index[item.id]] = i
        for i, needs in enumerate(deps):
            if needs:
                # Released by the commit of whichever of its dependencies finished last.
                assert released_by[i] == max(needs, key=done.index), (i, needs, done)
            else:
                assert i not in released_by


_names = (f"case{n}" for n in itertools.count())
