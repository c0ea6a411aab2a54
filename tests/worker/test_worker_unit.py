"""The worker loop over the in-memory store and transport (the real backends: tests/worker/test_worker_e2e.py)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent_dispatch.envelope import AgentTurnEnvelope, seal
from agent_dispatch.errors import LeaseLost
from agent_dispatch.lease import WorkItemLeaseGuard
from agent_dispatch.models import Outcome, WorkState
from agent_dispatch.settings import load
from agent_dispatch.stores.memory import MemoryStore
from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.memory import MemoryTransport
from agent_dispatch.worker import TurnFailed, Worker
from agent_dispatch.worker._executors import sleep
from tests.worker._support import KEY, enqueue, envelope_for, wait_for


class Recorder:
    """An executor that records each run and routes its one side effect through the guard."""

    def __init__(self, *, hold: float = 0.0) -> None:
        self.runs: list[tuple[str, int]] = []
        self.effects: list[tuple[str, int]] = []
        self.active: dict[str, int] = {}
        self.overlaps = 0
        self.hold = hold
        self.lock = threading.Lock()

    def __call__(
        self, env: AgentTurnEnvelope, payload: bytes, guard: WorkItemLeaseGuard, log: logging.Logger
    ) -> None:
        with self.lock:
            self.runs.append((env.job_id, guard.fencing_token))
            self.active[env.session_id] = self.active.get(env.session_id, 0) + 1
            if self.active[env.session_id] > 1:
                self.overlaps += 1
        try:
            time.sleep(self.hold)
            guard.side_effect(self._effect, env.job_id, guard.fencing_token)
        finally:
            with self.lock:
                self.active[env.session_id] -= 1

    def _effect(self, job_id: str, token: int) -> None:
        with self.lock:
            self.effects.append((job_id, token))


def make(executor: Any, *, concurrency: int = 2, **env: Any) -> tuple[MemoryStore, MemoryTransport, Worker]:
    settings = load(
        AGENT_DISPATCH_CLAIM_TTL_S=env.pop("ttl", 5),
        AGENT_DISPATCH_RENEW_INTERVAL_S=env.pop("renew", 1),
        AGENT_DISPATCH_SWEEP_INTERVAL_S=60,
        AGENT_DISPATCH_MAX_ATTEMPTS=env.pop("max_attempts", 3),
        **env,
    )
    store = MemoryStore(settings)
    transport = MemoryTransport(visibility_timeout_s=30)
    worker = Worker(settings, store, transport, executor, signing_key=KEY, concurrency=concurrency)
    return store, transport, worker


@pytest.fixture
def running() -> Iterator[list[Worker]]:
    workers: list[Worker] = []
    yield workers
    for worker in workers:
        worker.stop(grace_s=0)


def states(store: MemoryStore, ids: list[str]) -> list[WorkState]:
    return [store.get(i).state for i in ids]


def test_turns_succeed_exactly_once(running: list[Worker]) -> None:
    recorder = Recorder()
    store, transport, worker = make(recorder, concurrency=4)
    ids = [enqueue(store, transport, session_id=f"s{i}").id for i in range(40)]
    worker.start()
    running.append(worker)
    wait_for(lambda: all(s is WorkState.SUCCEEDED for s in states(store, ids)), what="all turns succeed")
    wait_for(lambda: transport.depth() == 0, what="all deliveries acknowledged")
    assert sorted(j for j, _ in recorder.effects) == sorted(ids)


@pytest.mark.parametrize(
    "wire",
    [
        b"not json",
        b'{"v":1,"env":{},"sig":"x"}',
        b'{"v":1,"env":{"job_id":"x"}}',
        seal(
            AgentTurnEnvelope(
                job_id="nope", session_id="s", kind="k", payload_ref="nope", tenant="acme", enqueued_at=0.0
            ),
            KEY,
        ),
    ],
    ids=["malformed", "unsigned-invalid", "unsigned", "no-such-workitem"],
)
def test_poison_is_dead_lettered_and_the_worker_carries_on(running: list[Worker], wire: bytes) -> None:
    recorder = Recorder()
    store, transport, worker = make(recorder)
    transport.admit([OutboundTurn("poison-1", "s", "acme", wire)])
    good = enqueue(store, transport)
    worker.start()
    running.append(worker)
    wait_for(lambda: store.get(good.id).state is WorkState.SUCCEEDED, what="good turn")
    wait_for(lambda: transport.depth() == 0, what="poison acknowledged")
    assert [j for j, _ in recorder.runs] == [good.id]


def test_forged_envelope_for_a_real_item_never_runs_nor_touches_it(running: list[Worker]) -> None:
    recorder = Recorder()
    store, transport, worker = make(recorder)
    item = enqueue(store, transport)
    # A second delivery for the same item, signed with another key: poison, and the item is untouched.
    forged = seal(envelope_for(item), b"x" * 40)
    transport.admit([OutboundTurn("forged", item.session_id, item.tenant, forged, priority=10)])
    worker.start()
    running.append(worker)
    wait_for(lambda: transport.depth() == 0, what="all deliveries settled")
    assert store.get(item.id).state is WorkState.SUCCEEDED
    assert len(recorder.runs) == 1


def test_expired_envelope_cancels_and_never_executes(running: list[Worker]) -> None:
    recorder = Recorder()
    store, transport, worker = make(recorder)
    item = enqueue(store, transport, deadline=time.time() - 1)
    worker.start()
    running.append(worker)
    wait_for(lambda: store.get(item.id).state is WorkState.CANCELLED, what="cancelled")
    wait_for(lambda: transport.depth() == 0, what="acknowledged")
    assert recorder.runs == []


def test_retryable_failure_retries_then_succeeds(running: list[Worker]) -> None:
    calls: list[int] = []

    def flaky(env: AgentTurnEnvelope, payload: bytes, guard: WorkItemLeaseGuard, log: logging.Logger) -> None:
        calls.append(guard.lease_epoch)
        if len(calls) == 1:
            raise TurnFailed("agent busy", retryable=True)

    store, transport, worker = make(flaky)
    item = enqueue(store, transport)
    worker.start()
    running.append(worker)
    wait_for(lambda: store.get(item.id).state is WorkState.SUCCEEDED, timeout=30, what="retry succeeded")
    assert len(calls) == 2 and calls[1] > calls[0]
    assert store.get(item.id).attempt == 2


def test_non_retryable_failure_is_final(running: list[Worker]) -> None:
    def refuse(
        env: AgentTurnEnvelope, payload: bytes, guard: WorkItemLeaseGuard, log: logging.Logger
    ) -> None:
        raise TurnFailed("bad request", retryable=False)

    store, transport, worker = make(refuse)
    item = enqueue(store, transport)
    worker.start()
    running.append(worker)
    wait_for(lambda: store.get(item.id).state is WorkState.FAILED, what="failed")
    wait_for(lambda: transport.depth() == 0, what="acknowledged")
    assert store.get(item.id).error == "bad request"


def test_attempts_spent_go_to_dead_letter(running: list[Worker]) -> None:
    def crash(env: AgentTurnEnvelope, payload: bytes, guard: WorkItemLeaseGuard, log: logging.Logger) -> None:
        raise RuntimeError("boom")

    store, transport, worker = make(crash, max_attempts=2)
    item = enqueue(store, transport)
    worker.start()
    running.append(worker)
    wait_for(lambda: store.get(item.id).state is WorkState.DEAD_LETTER, timeout=30, what="dead letter")
    wait_for(lambda: transport.depth() == 0, what="acknowledged")


def test_cancel_while_running_stops_the_turn_promptly(running: list[Worker]) -> None:
    store, transport, worker = make(sleep, renew=0.2)
    item = enqueue(store, transport, payload=json.dumps({"sleep_s": 30}).encode())
    worker.start()
    running.append(worker)
    wait_for(lambda: store.get(item.id).state is WorkState.RUNNING, what="running")
    started = time.monotonic()
    store.cancel(item.id, tenant="acme", reason="user asked")
    wait_for(lambda: transport.depth() == 0, timeout=10, what="cancelled delivery acknowledged")
    assert time.monotonic() - started < 5
    assert store.get(item.id).state is WorkState.CANCELLED


def test_a_cancelled_sleep_frees_its_worker_slot_promptly(running: list[Worker]) -> None:
    """With the default renewal pace (far longer than the test), not only when renewals are fast."""
    store, transport, worker = make(sleep, concurrency=1, ttl=120, renew=30)
    item = enqueue(store, transport, payload=json.dumps({"sleep_s": 60}).encode())
    worker.start()
    running.append(worker)
    wait_for(lambda: store.get(item.id).state is WorkState.RUNNING, what="running")
    started = time.monotonic()
    store.cancel(item.id, tenant="acme", reason="user asked")
    wait_for(lambda: transport.depth() == 0, timeout=10, what="cancelled delivery acknowledged")
    assert time.monotonic() - started < 2.0, "the slot was held past the cancellation"
    # The one slot is free again: the next turn runs now, not after the 60 s sleep.
    quick = enqueue(store, transport, payload=json.dumps({"sleep_s": 0}).encode())
    wait_for(lambda: store.get(quick.id).state is WorkState.SUCCEEDED, timeout=5, what="next turn")


def test_one_session_never_overlaps(running: list[Worker]) -> None:
    recorder = Recorder(hold=0.05)
    store, transport, worker = make(recorder, concurrency=4)
    ids = [enqueue(store, transport, session_id="same").id for _ in range(8)]
    worker.start()
    running.append(worker)
    wait_for(lambda: all(s is WorkState.SUCCEEDED for s in states(store, ids)), what="all done")
    assert recorder.overlaps == 0


def test_stale_worker_side_effect_and_commit_are_refused() -> None:
    recorder = Recorder()
    store, transport, _ = make(recorder)
    item = enqueue(store, transport)
    [delivery] = transport.claim("w/0")
    lease = store.claim("w/0", work_item_id=item.id, ttl_s=0.05)
    assert lease is not None
    time.sleep(0.1)
    newer = store.claim("w2/0", work_item_id=item.id, ttl_s=5)
    assert newer is not None and newer.fencing_token > lease.fencing_token
    guard = WorkItemLeaseGuard(store, lease, ttl_s=5, interval_s=1)
    with pytest.raises(LeaseLost):
        guard.side_effect(recorder._effect, item.id, lease.fencing_token)
    assert recorder.effects == []
    assert guard.lost.is_set()
    with pytest.raises(LeaseLost):
        store.commit(lease, Outcome.SUCCEEDED)
    assert store.get(item.id).lease_epoch == newer.lease_epoch
    transport.release(delivery.receipt)


def test_shutdown_past_grace_hands_the_turn_back(running: list[Worker]) -> None:
    store, transport, worker = make(sleep)
    item = enqueue(store, transport, payload=json.dumps({"sleep_s": 30}).encode())
    worker.start()
    wait_for(lambda: store.get(item.id).state is WorkState.RUNNING, what="running")
    worker.stop(grace_s=0.2)
    current = store.get(item.id)
    assert current.state is WorkState.READY
    assert current.attempt == 0  # deferral does not spend an attempt
    assert transport.depth() == 1  # the delivery is back in the queue, not lost
    # A second worker takes over at once and completes it.
    recorder = Recorder()
    other = Worker(worker.settings, store, transport, recorder, signing_key=KEY, concurrency=1)
    other.start()
    running.append(other)
    wait_for(lambda: store.get(item.id).state is WorkState.SUCCEEDED, what="completed elsewhere")


def test_a_commit_whose_outcome_is_unknown_is_asked_again_and_counted_once(running: list[Worker]) -> None:
    """The database applies the commit but the connection drops before the answer (a restart)."""
    from agent_dispatch.errors import BackendUnavailable
    from agent_dispatch.worker import _metrics

    recorder = Recorder()
    store, transport, worker = make(recorder, concurrency=1)
    real_commit = store.commit
    dropped: list[str] = []

    def commit_then_drop(lease: Any, outcome: Outcome, **kw: Any) -> Any:
        result = real_commit(lease, outcome, **kw)
        if not dropped:
            dropped.append(lease.work_item_id)
            raise BackendUnavailable("connection lost during COMMIT")
        return result

    real_commit_many = store.commit_many

    def commit_many_then_drop(commits: Any) -> Any:
        result = real_commit_many(commits)
        if not dropped:
            dropped.append(commits[0][0].work_item_id)
            raise BackendUnavailable("connection lost during COMMIT")
        return result

    store.commit = commit_then_drop  # type: ignore[method-assign]
    store.commit_many = commit_many_then_drop  # type: ignore[method-assign]
    before = _metrics.TURNS.labels("succeeded")._value.get()
    item = enqueue(store, transport)
    worker.start()
    running.append(worker)
    wait_for(lambda: transport.depth() == 0, what="acknowledged after the repeat")
    assert dropped == [item.id]
    assert store.get(item.id).state is WorkState.SUCCEEDED
    assert _metrics.TURNS.labels("succeeded")._value.get() == before + 1
    commits = [r for r in store.outcomes(item.id) if r.event == "commit"]
    assert len(commits) == 1
