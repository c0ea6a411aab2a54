"""The PostgreSQL WorkItem store under real concurrency and real clock skew (separate processes).

* 8 worker processes race to claim and commit 2,000 items: every item is committed exactly
  once, nobody gets an error, and PostgreSQL records no deadlock.
* A worker whose own clock is minutes off neither steals a live lease (clock ahead) nor keeps
  an expired one (clock behind): expiry is measured by the database clock only.
* Identical keyed submits racing through the single-submit path make one item; each gets the
  answer it would have had alone.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import Counter
from functools import partial
from typing import Any

import psycopg
import pytest

from agent_dispatch.errors import DispatchError, Fenced, LeaseExpired, LeaseHeld
from agent_dispatch.models import Lease, Outcome, SubmitRequest, WorkState
from agent_dispatch.stores.postgres import PostgresStore
from tests.contract._store_harness import store_settings

pytestmark = pytest.mark.postgres

ITEMS = 2000
PROCESSES = 8
SKEW_S = 600.0  # ten minutes


def _store(dsn: str, max_size: int = 2) -> PostgresStore:
    return PostgresStore(dsn, store_settings(claim_ttl_s=60, max_attempts=3), max_size=max_size)


# --- child processes (module level: spawned children import them) ----------------------------------


def race_worker(dsn: str, owner: str, barrier: Any) -> dict[str, Any]:
    """Claim and commit until nothing is left; report what was committed and every error."""
    store = _store(dsn, max_size=1)
    committed: list[tuple[str, int]] = []
    errors: list[str] = []
    barrier.wait(timeout=120)
    try:
        while True:
            lease = store.claim(owner)
            if lease is None:
                break
            store.mark_running(lease)
            result = store.commit(lease, Outcome.SUCCEEDED)
            assert not result.repeated
            committed.append((lease.work_item_id, lease.fencing_token))
    except Exception as exc:  # reported to the parent, which fails the test with it
        errors.append(f"{owner}: {exc!r}")
    finally:
        store.close()
    return {"owner": owner, "committed": committed, "errors": errors}


def _skew_clock(seconds: float) -> None:
    """This process's wall clock is ``seconds`` off. time.sleep and monotonic are unaffected."""
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + seconds  # type: ignore[assignment]
    time.time_ns = lambda: real_time_ns() + int(seconds * 1e9)  # type: ignore[assignment]


def skewed_ahead(dsn: str, held_id: str) -> dict[str, Any]:
    """Clock 10 minutes fast: the live lease on ``held_id`` looks long expired to it."""
    _skew_clock(+SKEW_S)
    store = _store(dsn)
    out: dict[str, Any] = {"local_now": time.time()}
    try:
        try:
            store.claim("skewed-ahead", work_item_id=held_id)
            out["named_claim"] = "claimed"
        except DispatchError as exc:
            out["named_claim"] = type(exc).__name__
        out["next_claim"] = store.claim("skewed-ahead")
        own = store.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"")).item
        lease = store.claim("skewed-ahead", work_item_id=own.id, ttl_s=60)
        assert lease is not None
        out["own_ttl_by_db"] = (lease.expires_at - store.now()).total_seconds()
        out["own_commit"] = store.commit(lease, Outcome.SUCCEEDED).item.state.value
    finally:
        store.close()
    return out


def skewed_behind(dsn: str, item_id: str) -> dict[str, Any]:
    """Clock 10 minutes slow: by its clock a 1 s lease has ten minutes left; by the database, none."""
    _skew_clock(-SKEW_S)
    store = _store(dsn)
    out: dict[str, Any] = {}
    try:
        lease = store.claim("skewed-behind", work_item_id=item_id, ttl_s=1.0)
        assert lease is not None
        out["lease"] = lease
        out["ttl_by_db"] = (lease.expires_at - store.now()).total_seconds()
        time.sleep(1.5)
        for name, call in (
            ("require_current", lambda: store.require_current(lease)),
            ("renew", lambda: store.renew(lease)),
            ("commit", lambda: store.commit(lease, Outcome.SUCCEEDED)),
        ):
            try:
                call()
                out[name] = "accepted"
            except DispatchError as exc:
                out[name] = type(exc).__name__
    finally:
        store.close()
    return out


def stale_commit(dsn: str, lease: Lease) -> str:
    _skew_clock(-SKEW_S)
    store = _store(dsn)
    try:
        store.commit(lease, Outcome.SUCCEEDED)
        return "accepted"
    except DispatchError as exc:
        return type(exc).__name__
    finally:
        store.close()


# --- tests ---------------------------------------------------------------------------------------------


def _deadlocks(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rec = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert rec is not None
    return int(rec[0])


def test_eight_processes_commit_two_thousand_items_exactly_once(postgres_dsn: str) -> None:
    setup = _store(postgres_dsn)
    setup.migrate()
    ids = [
        setup.submit(SubmitRequest(tenant=f"t{i % 4}", kind="turn", payload=b"{}")).item.id
        for i in range(ITEMS)
    ]
    deadlocks_before = _deadlocks(postgres_dsn)

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(PROCESSES)
        with ctx.Pool(PROCESSES) as pool:
            started = time.monotonic()
            results = pool.starmap(
                race_worker, [(postgres_dsn, f"worker-{n}", barrier) for n in range(PROCESSES)], chunksize=1
            )
            elapsed = time.monotonic() - started

    errors = [error for result in results for error in result["errors"]]
    assert errors == []
    committed = [item_id for result in results for item_id, _ in result["committed"]]
    tokens = [token for result in results for _, token in result["committed"]]
    assert len(committed) == ITEMS, "every item is committed"
    assert Counter(committed).most_common(1)[0][1] == 1, "no item is committed twice"
    assert set(committed) == set(ids)
    assert len(set(tokens)) == ITEMS, "every claim got its own fencing token"
    busy = [r["owner"] for r in results if r["committed"]]
    assert len(busy) >= 2, f"only {busy} claimed anything: that was no race"

    for tenant in ("t0", "t1", "t2", "t3"):
        items = setup.list_items(tenant=tenant, limit=ITEMS)
        assert {item.state for item in items} == {WorkState.SUCCEEDED}
        assert {(item.attempt, item.lease_epoch) for item in items} == {(1, 1)}
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        per_item = conn.execute(
            "SELECT count(*) FILTER (WHERE event = 'commit'), count(DISTINCT work_item_id)"
            " FROM agent_dispatch_outcomes WHERE event = 'commit'"
        ).fetchone()
    assert per_item == (ITEMS, ITEMS), "exactly one commit record per item"
    assert _deadlocks(postgres_dsn) == deadlocks_before == 0
    setup.close()
    shares = {r["owner"]: len(r["committed"]) for r in results}
    print(
        f"{PROCESSES} processes, {ITEMS} items in {elapsed:.1f}s (spawn included); commits per worker {shares}"
    )


def test_a_worker_with_a_fast_clock_does_not_steal_a_live_lease(postgres_dsn: str) -> None:
    store = _store(postgres_dsn)
    store.migrate()
    held = store.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"")).item
    lease = store.claim("honest", work_item_id=held.id, ttl_s=60)
    assert lease is not None
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        out = pool.apply(skewed_ahead, (postgres_dsn, held.id))
    assert out["local_now"] > time.time() + SKEW_S - 60, "the child's clock really was skewed"
    assert out["named_claim"] == LeaseHeld.__name__
    assert out["next_claim"] is None
    # Its own lease is measured by the database: 60 s, not 60 s plus its ten-minute error.
    assert 55 <= out["own_ttl_by_db"] <= 60
    assert out["own_commit"] == "succeeded"
    store.require_current(lease)
    assert not store.commit(lease, Outcome.SUCCEEDED).repeated
    store.close()


def test_a_worker_with_a_slow_clock_does_not_keep_an_expired_lease(postgres_dsn: str) -> None:
    store = _store(postgres_dsn)
    store.migrate()
    item = store.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"")).item
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        out = pool.apply(skewed_behind, (postgres_dsn, item.id))
        assert out["ttl_by_db"] <= 1.0
        assert (out["require_current"], out["renew"], out["commit"]) == (LeaseExpired.__name__,) * 3
        # The honest worker reclaims it, and the slow-clocked one is fenced from then on.
        fresh = store.claim("honest", work_item_id=item.id)
        assert fresh is not None and fresh.lease_epoch == out["lease"].lease_epoch + 1
        assert pool.apply(stale_commit, (postgres_dsn, out["lease"])) == Fenced.__name__
    assert store.commit(fresh, Outcome.SUCCEEDED).item.state is WorkState.SUCCEEDED
    store.close()


# --- dependencies under concurrency ---------------------------------------------------------------------


def _in_parallel(*calls: Any) -> list[Any]:
    """Run the calls on threads released together; return their results (or exceptions)."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        barrier.wait(timeout=30)
        try:
            results[index] = calls[index]()
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def _submitted_id(store: PostgresStore, request: SubmitRequest) -> str:
    return store.submit(request).item.id


@pytest.mark.parametrize("outcome", [Outcome.SUCCEEDED, Outcome.FAILED])
def test_a_dependent_submitted_while_its_dependency_settles_is_never_stranded(
    postgres_dsn: str, outcome: Outcome
) -> None:
    """Submits race the dependency's commit; each dependent ends ready (or cancelled), never stuck."""
    store = _store(postgres_dsn, max_size=8)
    store.migrate()
    want = WorkState.READY if outcome is Outcome.SUCCEEDED else WorkState.CANCELLED
    for _ in range(15):
        root = store.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"")).item
        lease = store.claim("w", work_item_id=root.id)
        assert lease is not None

        request = SubmitRequest(tenant="t1", kind="turn", payload=b"", depends_on=(root.id,))
        submits = [partial(_submitted_id, store, request) for _ in range(5)]
        results = _in_parallel(partial(store.commit, lease, outcome), *submits)
        assert not [r for r in results if isinstance(r, Exception)]
        for item_id in results[1:]:
            assert store.get(item_id).state is want, "a dependent was stranded"


def test_two_dependencies_committing_at_once_release_their_dependent(postgres_dsn: str) -> None:
    store = _store(postgres_dsn, max_size=4)
    store.migrate()
    for _ in range(20):
        a, b = (store.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"")).item for _ in range(2))
        child = store.submit(
            SubmitRequest(tenant="t1", kind="turn", payload=b"", depends_on=(a.id, b.id))
        ).item
        lease_a, lease_b = store.claim("w", work_item_id=a.id), store.claim("w", work_item_id=b.id)
        assert lease_a is not None and lease_b is not None
        results = _in_parallel(
            partial(store.commit, lease_a, Outcome.SUCCEEDED),
            partial(store.commit, lease_b, Outcome.SUCCEEDED),
        )
        assert not [r for r in results if isinstance(r, Exception)]
        assert store.get(child.id).state is WorkState.READY
    store.close()


def _race_submits(store: PostgresStore, requests: list[SubmitRequest]) -> list[tuple[bytes, Any]]:
    """Each request submitted by its own thread, all released at once: (payload, result or error)."""
    start = threading.Barrier(len(requests))
    answers: list[tuple[bytes, Any]] = []
    lock = threading.Lock()

    def submit(request: SubmitRequest) -> None:
        start.wait(timeout=30)
        try:
            answer: Any = store.submit(request)
        except DispatchError as exc:
            answer = exc
        with lock:
            answers.append((request.payload, answer))

    threads = [threading.Thread(target=submit, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return answers


def test_identical_submits_racing_make_one_item_and_each_gets_its_answer(postgres_dsn: str) -> None:
    """Eight threads submit the same keyed request at once (and two a different body under that
    key), each through the single-submit path, which finds a repeat by its insert's conflict: one
    item is created, every submit with the winner's body answers it, every other body is a
    conflict."""
    from agent_dispatch.errors import IdempotencyConflict

    store = _store(postgres_dsn, max_size=10)
    store.migrate()
    try:
        for round_no in range(5):
            key = f"race-{round_no}"
            same = SubmitRequest(tenant="t", kind="k", payload=b'{"n": 1}', idempotency_key=key)
            other = SubmitRequest(tenant="t", kind="k", payload=b'{"n": 2}', idempotency_key=key)
            answers = _race_submits(store, [same] * 8 + [other] * 2)
            assert len(answers) == 10
            created = [a for _, a in answers if not isinstance(a, DispatchError) and a.created]
            assert len(created) == 1, answers
            winner = created[0]
            items = store.list_items(tenant="t", limit=100)
            assert [i.id for i in items if i.idempotency_key == key] == [winner.item.id]
            winner_payload = next(p for p, a in answers if a is winner)
            for payload, answer in answers:
                if payload == winner_payload:
                    assert not isinstance(answer, DispatchError), answer
                    assert answer.item.id == winner.item.id
                else:
                    assert isinstance(answer, IdempotencyConflict), answer
    finally:
        store.close()
