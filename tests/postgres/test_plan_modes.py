"""Generic plans where the plan cannot depend on the parameters, and only there.

The worker's batched calls (``start_many``, ``commit_many``) reach their rows by primary key, so
the store switches the borrowed session to ``plan_cache_mode = force_generic_plan`` for them and
back to the default for every other call (a browse whose tenant filter may be NULL needs a plan
for its values). The queue's claim, admission and acknowledgement functions carry the same
setting; its maintenance functions keep the default.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch.models import Outcome, SubmitRequest
from agent_dispatch.stores.postgres import PostgresStore
from agent_dispatch.transports.postgres import PostgresTransport
from tests.contract._store_harness import store_settings

pytestmark = pytest.mark.postgres

SHOW = "SELECT current_setting('plan_cache_mode') AS mode"


@pytest.fixture
def store(postgres_dsn: str) -> Iterator[PostgresStore]:
    # One pooled session, so every call below borrows the same one.
    store = PostgresStore(postgres_dsn, store_settings(), min_size=1, max_size=1)
    store.migrate()
    yield store
    store.close()


def _mode(store: PostgresStore, *, generic: bool) -> str:
    rec = store._run(lambda c: c.execute(SHOW).fetchone(), transaction=False, generic_plans=generic)
    assert rec is not None
    return str(rec["mode"])


def _start_and_commit(store: PostgresStore, n: int) -> None:
    items = [store.submit(SubmitRequest(tenant="t", kind="k", payload=b"{}")).item for _ in range(n)]
    started = store.start_many("w1", [(i.id, i.tenant) for i in items], ttl_s=60)
    assert set(started) == {i.id for i in items}
    done = store.commit_many([(t.lease, Outcome.SUCCEEDED, None) for t in started.values()])
    assert set(done) == {i.id for i in items}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["generic", "default", "batch", "browse"]), min_size=1, max_size=12))
def test_every_call_runs_in_the_mode_it_asks_for(store: PostgresStore, calls: list[str]) -> None:
    for call in calls:
        if call == "batch":
            _start_and_commit(store, 2)
            assert _mode(store, generic=True) == "force_generic_plan"
        elif call == "browse":
            store.browse(tenant=None, limit=5)
            assert _mode(store, generic=False) == "auto"
        else:
            generic = call == "generic"
            assert _mode(store, generic=generic) == ("force_generic_plan" if generic else "auto")


def test_the_batched_start_is_planned_once_and_reused(store: PostgresStore) -> None:
    for _ in range(8):
        _start_and_commit(store, 1)
    rows = store._run(
        lambda c: c.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE statement LIKE '%%cand%%' AND statement LIKE '%%agent_dispatch_work_items%%'"
        ).fetchall(),
        transaction=False,
        generic_plans=True,
    )
    # psycopg prepares a statement on its 5th use; from then on it runs the one generic plan.
    assert rows, "start_many was not prepared on the session"
    assert all(r["custom_plans"] == 0 and r["generic_plans"] >= 3 for r in rows), rows


def test_queue_functions_carry_their_plan_mode(postgres_dsn: str) -> None:
    queue = PostgresTransport(postgres_dsn, max_depth=100, visibility_timeout_s=60)
    try:
        queue.ensure_ready()
        with psycopg.connect(postgres_dsn) as conn:
            config = dict(
                conn.execute(
                    "SELECT proname, coalesce(proconfig, '{}') FROM pg_proc"
                    " WHERE proname LIKE 'agent_dispatch_queue_%%'"
                ).fetchall()
            )
    finally:
        queue.close()
    generic = ["plan_cache_mode=force_generic_plan"]
    assert config["agent_dispatch_queue_admit"] == generic
    assert config["agent_dispatch_queue_ack"] == generic
    assert config["agent_dispatch_queue_claim"] == generic
    assert config["agent_dispatch_queue_prune"] == []
