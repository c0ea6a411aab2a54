"""Dependents start at the commit that releases them, not at the next recovery sweep (issue 22).

On the real backends: the SQLite queue in the store's file and the PostgreSQL queue in the
store's database admit a released dependent inside the dependency's commit transaction; Kafka
(WorkItems in PostgreSQL) admits it right after the commit; the in-process memory pair too. The
sweep runs every 300 s in these tests, so a chain that finishes in seconds was not its work.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch.dispatch import choose_admission
from agent_dispatch.models import Outcome, SubmitRequest, WorkItem, WorkState
from agent_dispatch.runtime import open_runtime
from agent_dispatch.settings import Settings, load
from agent_dispatch.store import WorkItemStore
from agent_dispatch.stores.memory import MemoryStore
from agent_dispatch.transport import Transport
from agent_dispatch.transports.memory import MemoryTransport
from agent_dispatch.worker import Worker
from tests.worker._support import KEY, wait_for
from tests.worker.test_worker_unit import Recorder

SWEEP_S = 300  # far longer than any of these tests: the sweep never runs in them
CHAIN = 5

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("kafka", id="kafka", marks=[pytest.mark.kafka, pytest.mark.postgres]),
]
#: Whether the backend's commit admits released dependents in its own transaction.
IN_COMMIT = {"memory": False, "sqlite": True, "postgres": True, "kafka": False}


def backend_settings(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> Settings:
    env: dict[str, Any] = {
        "AGENT_DISPATCH_SIGNING_KEY": KEY.decode(),
        "AGENT_DISPATCH_DATA_DIR": str(tmp_path / "data"),
        "AGENT_DISPATCH_SWEEP_INTERVAL_S": SWEEP_S,
        "AGENT_DISPATCH_CLAIM_TTL_S": 10,
        "AGENT_DISPATCH_RENEW_INTERVAL_S": 2,
        "AGENT_DISPATCH_LOG_LEVEL": "WARNING",
    }
    if name in {"memory", "sqlite"}:
        env["TASK_QUEUE_BACKEND"] = "sqlite"
    else:
        env["TASK_QUEUE_BACKEND"] = name
        env["STATE_DB_URI"] = request.getfixturevalue("postgres_dsn")
    if name == "kafka":
        env["KAFKA_BOOTSTRAP_SERVERS"] = request.getfixturevalue("kafka_bootstrap")
        env["AGENT_DISPATCH_KAFKA_TOPIC"] = request.getfixturevalue("kafka_topic_name")
        env["AGENT_DISPATCH_KAFKA_GROUP"] = f"deps-{uuid.uuid4().hex[:8]}"
        env["AGENT_TURNS_PARTITIONS"] = "2"
    return load(**env)


@pytest.fixture
def parts(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, Settings, WorkItemStore, Transport]]:
    name: str = request.param
    settings = backend_settings(name, tmp_path, request)
    if name == "memory":
        store, transport = MemoryStore(settings), MemoryTransport(visibility_timeout_s=30)
        yield name, settings, store, transport
        return
    runtime = open_runtime(settings, migrate=True)
    try:
        yield name, settings, runtime.store, runtime.transport
    finally:
        runtime.close()


@contextlib.contextmanager
def running(worker: Worker) -> Iterator[Worker]:
    worker.start()
    try:
        yield worker
    finally:
        worker.stop(grace_s=0)


def submit_chain(settings: Settings, store: WorkItemStore, transport: Transport, n: int) -> list[WorkItem]:
    """``n`` turns, each depending on the one before, admitted as the gateway would."""
    admission = choose_admission(store, transport, signing_key=KEY, settings=settings)
    chain: list[WorkItem] = []
    for index in range(n):
        after = (chain[-1].id,) if chain else ()
        request = SubmitRequest(
            tenant="acme", kind="turn", payload=f'{{"n": {index}}}'.encode(), depends_on=after
        )
        chain.append(admission.enqueue(request).item)
    return chain


def event_at(store: WorkItemStore, item_id: str, event: str) -> float:
    return next(r.at.timestamp() for r in store.outcomes(item_id) if r.event == event)


@pytest.mark.parametrize("parts", BACKENDS, indirect=True)
def test_a_dependency_chain_runs_link_after_link_without_the_sweep(
    parts: tuple[str, Settings, WorkItemStore, Transport],
) -> None:
    name, settings, store, transport = parts
    recorder = Recorder()
    worker = Worker(settings, store, transport, recorder, signing_key=KEY, concurrency=2)
    assert worker.committer.in_transaction is IN_COMMIT[name]
    chain = submit_chain(settings, store, transport, CHAIN)
    assert [item.state for item in chain] == [WorkState.READY] + [WorkState.SUBMITTED] * (CHAIN - 1)
    with running(worker):
        wait_for(
            lambda: all(store.get(item.id).state is WorkState.SUCCEEDED for item in chain),
            timeout=30,
            what="the whole chain to succeed",
        )
    assert [job for job, _ in recorder.runs] == [item.id for item in chain]  # in order, once each
    for parent, child in itertools.pairwise(chain):
        # From the commit that released it to its claim: well under a second here, while the
        # sweep would have taken up to SWEEP_S.
        gap = event_at(store, child.id, "claim") - event_at(store, parent.id, "commit")
        assert 0 <= gap < 5, (name, gap)


# --- when the dispatch at the commit fails: the commit stands, the next layer catches it ------------


def memory_parts() -> tuple[Settings, MemoryStore, MemoryTransport]:
    settings = load(AGENT_DISPATCH_SWEEP_INTERVAL_S=SWEEP_S, AGENT_DISPATCH_CLAIM_TTL_S=10)
    return settings, MemoryStore(settings), MemoryTransport(visibility_timeout_s=30)


def test_a_transport_that_refuses_the_released_dependent_leaves_it_to_the_sweep() -> None:
    settings, store, transport = memory_parts()
    worker = Worker(settings, store, transport, Recorder(), signing_key=KEY)
    parent, child = submit_chain(settings, store, transport, 2)
    admit: Callable[..., Any] = transport.admit

    def refusing(turns: Any, *, bounded: bool = True) -> None:
        if any(t.work_item_id == child.id for t in turns):
            raise RuntimeError("broker down")
        admit(turns, bounded=bounded)

    transport.admit = refusing  # type: ignore[method-assign]
    lease = store.claim("w", work_item_id=parent.id)
    assert lease is not None
    result = worker.committer.commit(lease, Outcome.SUCCEEDED)
    assert result.item.state is WorkState.SUCCEEDED  # the commit is not failed by the dispatch
    assert store.get(child.id).state is WorkState.READY
    assert transport.depth() == 1  # the parent's delivery only
    assert child.id in {i.id for i in store.recoverable(stale_after_s=3600)}  # first for the sweep


def test_a_failed_admission_in_the_commit_falls_back_to_the_transport_after_it(tmp_path: Path) -> None:
    settings = load(
        AGENT_DISPATCH_SIGNING_KEY=KEY.decode(),
        AGENT_DISPATCH_DATA_DIR=str(tmp_path / "data"),
        AGENT_DISPATCH_SWEEP_INTERVAL_S=SWEEP_S,
        TASK_QUEUE_BACKEND="sqlite",
    )
    with open_runtime(settings) as runtime:
        store, transport = runtime.store, runtime.transport
        worker = Worker(settings, store, transport, Recorder(), signing_key=KEY)
        assert worker.committer.in_transaction
        parent, child = submit_chain(settings, store, transport, 2)

        admit_on = transport.admit_on  # type: ignore[attr-defined]
        calls: list[int] = []

        def failing_once(*args: Any, **kwargs: Any) -> int:
            # The admission inside the commit fails; the transport's own admission after it works.
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("the queue's statement failed")
            return int(admit_on(*args, **kwargs))

        transport.admit_on = failing_once  # type: ignore[attr-defined]
        lease = store.claim("w", work_item_id=parent.id)
        assert lease is not None
        assert worker.committer.commit(lease, Outcome.SUCCEEDED).item.state is WorkState.SUCCEEDED
        delivered = transport.claim("w", max_items=5)
        assert child.id in [d.work_item_id for d in delivered]
        assert child.id not in {i.id for i in store.recoverable(stale_after_s=3600)}  # stamped after
