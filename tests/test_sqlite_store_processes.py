"""Several local processes share one SQLite store file (``agent-dispatch up`` runs more than one).

``BEGIN IMMEDIATE`` serialises their writes across processes: every item is committed exactly
once, fencing tokens stay unique store-wide, and leader election picks one process.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from pathlib import Path
from typing import Any

from agent_dispatch.models import Outcome, SubmitRequest, WorkState
from agent_dispatch.stores.sqlite import SqliteStore
from tests.contract._store_harness import store_settings

ITEMS = 300
PROCESSES = 4


def sqlite_worker(path: str, owner: str, barrier: Any) -> dict[str, Any]:
    store = SqliteStore(Path(path), store_settings())
    committed: list[tuple[str, int]] = []
    errors: list[str] = []
    barrier.wait(timeout=120)
    leader = store.try_lead("recovery-sweep")
    try:
        while (lease := store.claim(owner)) is not None:
            store.mark_running(lease)
            store.commit(lease, Outcome.SUCCEEDED)
            committed.append((lease.work_item_id, lease.fencing_token))
        barrier.wait(timeout=120)  # hold leadership until everyone has tried to take it
    except Exception as exc:  # reported to the parent
        errors.append(f"{owner}: {exc!r}")
    finally:
        store.close()
    return {"committed": committed, "errors": errors, "leader": leader}


def test_processes_share_one_sqlite_store_safely(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite3"
    store = SqliteStore(path, store_settings())
    store.migrate()
    ids = {store.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"")).item.id for _ in range(ITEMS)}
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(PROCESSES)
        with ctx.Pool(PROCESSES) as pool:
            results = pool.starmap(sqlite_worker, [(str(path), f"p{n}", barrier) for n in range(PROCESSES)])
    assert [e for r in results for e in r["errors"]] == []
    committed = [item for r in results for item, _ in r["committed"]]
    assert Counter(committed).most_common(1)[0][1] == 1
    assert set(committed) == ids
    tokens = [token for r in results for _, token in r["committed"]]
    assert len(set(tokens)) == ITEMS
    assert sum(r["leader"] for r in results) == 1
    assert {item.state for item in store.list_items(tenant="t1", limit=ITEMS)} == {WorkState.SUCCEEDED}
    store.close()
