"""``WorkItemStore.get_many`` (one read for many ids) agrees with ``get`` on every store."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch.errors import NotFound
from agent_dispatch.models import Outcome, SubmitRequest, WorkItem
from agent_dispatch.store import WorkItemStore
from tests.contract._store_harness import (  # noqa: F401 (store_postgres_dsn is a fixture)
    BACKENDS,
    Harness,
    open_harness,
    store_postgres_dsn,
)


@pytest.fixture(params=BACKENDS)
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    with open_harness(request.param, request, tmp_path) as harness:
        yield harness


def submit(store: WorkItemStore, tenant: str) -> WorkItem:
    return store.submit(SubmitRequest(tenant=tenant, kind="turn", payload=b"{}")).item


def test_get_many_returns_exactly_what_get_returns_for_each_id(h: Harness) -> None:
    s = h.store
    ready = [submit(s, "t1"), submit(s, "t1"), submit(s, "t2")]
    claimed = s.claim("w1", work_item_id=submit(s, "t2").id)
    finished = s.claim("w1", work_item_id=submit(s, "t1").id)
    assert claimed is not None and finished is not None
    s.commit(finished, Outcome.SUCCEEDED)
    known = [item.id for item in ready] + [claimed.work_item_id, finished.work_item_id]

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(
        ids=st.lists(st.sampled_from([*known, "no-such-item", ""]), max_size=8),
        tenant=st.sampled_from([None, "t1", "t2", "t3"]),
    )
    def agrees(ids: list[str], tenant: str | None) -> None:
        expected: dict[str, WorkItem] = {}
        for work_item_id in ids:
            with contextlib.suppress(NotFound):
                expected[work_item_id] = s.get(work_item_id, tenant=tenant)
        assert s.get_many(ids, tenant=tenant) == expected

    agrees()
    # The item as it is now, never an older copy: a state change is seen by the next read.
    assert s.get_many([claimed.work_item_id])[claimed.work_item_id].state.value == "leased"
    s.commit(claimed, Outcome.FAILED, error="boom")
    assert s.get_many([claimed.work_item_id]) == {claimed.work_item_id: s.get(claimed.work_item_id)}
