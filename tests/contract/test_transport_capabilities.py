"""The optional capabilities, each a Protocol of its own (``agent_dispatch.transport`` and
``agent_dispatch.store``): which implementation has which, and that each keeps its promise. The
admission strategy a store/transport pair gets follows from them (``dispatch.choose_admission``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch import dispatch
from agent_dispatch.errors import QueueFull
from agent_dispatch.models import SubmitRequest, WorkItem
from agent_dispatch.runtime import Runtime, open_runtime
from agent_dispatch.settings import Backend
from agent_dispatch.store import BatchSubmit, CountsUnfinished, TransactionalSubmit
from agent_dispatch.transport import AckMany, AdmitOnConnection, Receipt, Transport, WakesClaims
from tests.contract._transport_harness import (
    ALL_BACKENDS,
    MEMORY,
    MakeTransport,
    Owner,
    eventually,
    settings_for,
    turn,
)

#: What each implementation offers beyond the Transport Protocol (a change here is a decision).
CAPABILITIES: dict[Backend | str, set[type]] = {
    MEMORY: {AckMany, WakesClaims},
    Backend.SQLITE: {AckMany, AdmitOnConnection, WakesClaims},
    Backend.POSTGRES: {AckMany, AdmitOnConnection, WakesClaims},
    Backend.KAFKA: set(),
}
IDENTITY: dict[Backend | str, Backend | None] = {
    MEMORY: None,
    Backend.SQLITE: Backend.SQLITE,
    Backend.POSTGRES: Backend.POSTGRES,
    Backend.KAFKA: Backend.KAFKA,
}


def backend_of(request: pytest.FixtureRequest) -> Backend | str:
    value: Backend | str = request.node.callspec.params["make_transport"]
    return value


def test_each_transport_names_itself_and_has_exactly_its_capabilities(
    request: pytest.FixtureRequest, make_transport: MakeTransport
) -> None:
    backend = backend_of(request)
    transport = make_transport()
    assert isinstance(transport, Transport)
    assert transport.backend is IDENTITY[backend], "the memory transport must not pose as a real backend"
    offered = {cap for cap in (AckMany, AdmitOnConnection, WakesClaims) if isinstance(transport, cap)}
    assert offered == CAPABILITIES[backend]


def test_wake_claims_ends_a_waiting_claim_and_later_claims_still_wait(
    request: pytest.FixtureRequest, make_transport: MakeTransport
) -> None:
    """A stopping worker wakes its claim loops: the claims waiting return (empty) long before
    their wait is out, and a claim made afterwards waits and delivers as before."""
    transport = make_transport()
    if WakesClaims not in CAPABILITIES[backend_of(request)]:
        assert not isinstance(transport, WakesClaims)
        return
    assert isinstance(transport, WakesClaims)
    transport.claim("w1", wait_s=0)  # any lazy start-up (schema, listener) done before the wait
    results: list[list[Any]] = []
    waiting = [
        threading.Thread(target=lambda: results.append(transport.claim("w1", wait_s=60))) for _ in range(3)
    ]
    for thread in waiting:
        thread.start()
    time.sleep(0.3)  # the claims are in their wait
    assert all(thread.is_alive() for thread in waiting), "a claim returned before the wake"
    transport.wake_claims()
    woken_by = time.monotonic() + 15  # (a claim not woken would wait its 60 s)
    for thread in waiting:
        thread.join(timeout=max(0.0, woken_by - time.monotonic()))
    assert not any(thread.is_alive() for thread in waiting), "wake_claims left a claim waiting"
    assert results == [[], [], []]
    later: list[list[Any]] = []
    thread = threading.Thread(target=lambda: later.append(transport.claim("w1", wait_s=60)))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive(), "a claim made after the wake did not wait"
    sent = turn(1)
    transport.admit([sent])
    thread.join(timeout=20)
    assert [d.work_item_id for d in later[0]] == [sent.work_item_id]


def test_ack_many_acknowledges_its_own_and_returns_the_rest(
    request: pytest.FixtureRequest,
    make_transport: MakeTransport,
    owners: Callable[[Transport, str], Owner],
) -> None:
    transport = make_transport()
    if AckMany not in CAPABILITIES[backend_of(request)]:
        assert not isinstance(transport, AckMany)
        return
    assert isinstance(transport, AckMany)
    worker = owners(transport, "w1")
    transport.admit([turn(i) for i in range(4)])
    got = worker.collect(4)
    assert len(got) == 4
    worker.ack(got[3].receipt)
    foreign = Receipt("w2", got[0].receipt.token)  # another owner naming our first delivery
    stale = got[3].receipt  # acknowledged already
    malformed = Receipt("w1", "not-a-receipt")
    mine = [d.receipt for d in got[1:3]]
    refused = worker._run(transport.ack_many, [foreign, *mine, stale, malformed])
    assert sorted(refused, key=str) == sorted([foreign, stale, malformed], key=str)  # in any order
    assert transport.depth() == 1  # the foreign receipt removed nothing
    assert worker._run(transport.ack_many, [got[0].receipt]) == []
    eventually(lambda: transport.depth() == 0, polling=worker)
    again = worker._run(transport.ack_many, mine)
    assert sorted(again, key=str) == sorted(mine, key=str), "acknowledged receipts are stale now"


@pytest.fixture(params=ALL_BACKENDS)
def make_runtime(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Runtime]]:
    """Store and transport of one settings, as every entry point opens them."""
    backend: Backend | str = request.param
    opened: list[Runtime] = []

    def make(**values: Any) -> Runtime:
        if backend == MEMORY:
            pytest.fail("the memory transport has no settings to open a runtime from")
        assert isinstance(backend, Backend)
        extra: dict[str, Any] = {}
        if backend is Backend.KAFKA:
            extra["state_db_uri"] = request.getfixturevalue("postgres_dsn")
        runtime = open_runtime(settings_for(request, tmp_path, backend, **values, **extra), migrate=True)
        opened.append(runtime)
        return runtime

    yield make
    for runtime in opened:
        runtime.close()


def request_for(key: str) -> SubmitRequest:
    return SubmitRequest(tenant="tenant-a", kind="chat", payload=b"{}", idempotency_key=key)


@pytest.mark.parametrize(
    "make_runtime",
    [p for p in ALL_BACKENDS if p.values[0] != MEMORY],
    indirect=True,
)
def test_the_admission_strategy_follows_the_capabilities(
    request: pytest.FixtureRequest, make_runtime: Callable[..., Runtime]
) -> None:
    runtime = make_runtime()
    backend = request.node.callspec.params["make_runtime"]
    expected = {
        Backend.SQLITE: dispatch.OneTransaction,
        Backend.POSTGRES: dispatch.OneTransaction,
        Backend.KAFKA: dispatch.Counted,
    }[backend]
    assert type(runtime.admission) is expected
    assert runtime.admission is runtime.admission, "chosen once per pair"
    assert isinstance(runtime.store, TransactionalSubmit) and isinstance(runtime.store, BatchSubmit)
    assert isinstance(runtime.store, CountsUnfinished)


@pytest.mark.parametrize(
    "make_runtime",
    [p for p in ALL_BACKENDS if p.values[0] in (Backend.SQLITE, Backend.POSTGRES)],
    indirect=True,
)
def test_admit_on_joins_the_stores_transaction(
    make_runtime: Callable[..., Runtime], owners: Callable[[Transport, str], Owner]
) -> None:
    runtime = make_runtime(max_depth=1)
    store, transport = runtime.store, runtime.transport
    assert isinstance(store, TransactionalSubmit) and isinstance(transport, AdmitOnConnection)
    assert store.database_identity == transport.database_identity
    key = b"contract-suite-signing-key-0123456789abcdef"

    def admit(conn: Any, item: WorkItem) -> None:
        assert transport.admit_on(conn, [dispatch.build_turn(item, signing_key=key)]) == 1

    kept = store.submit_in_transaction(request_for("kept"), admit, dispatched=True)
    assert transport.depth() == 1
    # The queue is full now: the admission raises inside the transaction, taking the submit with it.
    with pytest.raises(QueueFull):
        store.submit_in_transaction(request_for("refused"), admit, dispatched=True)
    assert [i.id for i in store.list_items(tenant="tenant-a")] == [kept.item.id]
    worker = owners(transport, "w1")
    assert worker.claim_one().work_item_id == kept.item.id


def test_a_store_in_another_database_gets_its_strategy_from_the_transport(
    make_transport: MakeTransport, request: pytest.FixtureRequest
) -> None:
    """A pair with no shared database and a store without the unfinished count refuses after the
    submit (and cancels): the in-memory store of unit tests, on any transport."""
    from agent_dispatch.settings import Settings
    from agent_dispatch.stores.memory import MemoryStore

    transport = make_transport()
    store = MemoryStore()
    admission = dispatch.choose_admission(
        store, transport, signing_key=b"k" * 40, settings=Settings(max_depth=1000)
    )
    assert type(admission) is dispatch.AfterSubmit
