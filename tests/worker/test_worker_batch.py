"""Batches: short turns share their round trips; a long turn never strands the turns behind it."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_dispatch.envelope import AgentTurnEnvelope
from agent_dispatch.lease import WorkItemLeaseGuard, session_execution_guard
from agent_dispatch.models import WorkState
from agent_dispatch.worker import Worker
from agent_dispatch.worker._batch import HOLD_S
from agent_dispatch.worker._loop import BATCH_PAYLOAD_BYTES, BATCH_WORK_S, SHORT_TURN_S, claim_size
from tests.worker._support import enqueue, wait_for
from tests.worker.test_worker_unit import Recorder, make, states


@pytest.fixture
def running() -> Iterator[list[Worker]]:
    workers: list[Worker] = []
    yield workers
    for worker in workers:
        worker.stop(grace_s=0)


class SlowFirst(Recorder):
    """Holds the turn whose payload says ``slow`` for ``slow_s``; every other turn is instant."""

    def __init__(self, slow_s: float) -> None:
        super().__init__()
        self.slow_s = slow_s

    def __call__(
        self, env: AgentTurnEnvelope, payload: bytes, guard: WorkItemLeaseGuard, log: logging.Logger
    ) -> None:
        self.hold = self.slow_s if json.loads(payload).get("slow") else 0.0
        super().__call__(env, payload, guard, log)


def claim_sizes(worker: Worker) -> list[int]:
    """Record how many deliveries each claim returned."""
    sizes: list[int] = []
    claim = worker.transport.claim

    def recording(owner: str, *, max_items: int = 1, wait_s: float = 0.0) -> Any:
        got = claim(owner, max_items=max_items, wait_s=wait_s)
        if got:
            sizes.append(len(got))
        return got

    worker.transport.claim = recording  # type: ignore[method-assign]
    return sizes


def test_short_turns_are_claimed_and_committed_in_batches(running: list[Worker]) -> None:
    recorder = Recorder()
    store, transport, worker = make(recorder, concurrency=1, AGENT_DISPATCH_CLAIM_BATCH=8)
    ids = [enqueue(store, transport, session_id=f"s{i}").id for i in range(60)]
    sizes = claim_sizes(worker)
    worker.start()
    running.append(worker)
    wait_for(lambda: all(s is WorkState.SUCCEEDED for s in states(store, ids)), what="all turns succeed")
    wait_for(lambda: transport.depth() == 0, what="all deliveries acknowledged")
    assert sorted(j for j, _ in recorder.effects) == sorted(ids)
    # The first claim takes one (turn length unknown), later ones take the batch.
    assert sizes[0] == 1
    assert max(sizes) == 8
    for item_id in ids:
        events = [r.event for r in store.outcomes(item_id)]
        assert events == ["submit", "claim", "running", "commit"], (item_id, events)


def test_long_turns_are_claimed_one_at_a_time(running: list[Worker]) -> None:
    recorder = Recorder(hold=0.06)
    store, transport, worker = make(recorder, concurrency=1, AGENT_DISPATCH_CLAIM_BATCH=8)
    ids = [enqueue(store, transport, session_id=f"s{i}").id for i in range(6)]
    sizes = claim_sizes(worker)
    worker.start()
    running.append(worker)
    wait_for(lambda: all(s is WorkState.SUCCEEDED for s in states(store, ids)), what="all turns succeed")
    assert sizes == [1] * 6


@pytest.mark.parametrize("ttl", [5.0, 1.0], ids=["within-ttl", "longer-than-ttl"])
def test_a_long_turn_hands_back_the_turns_waiting_behind_it(running: list[Worker], ttl: float) -> None:
    """The slow turn runs first in a batch; the rest are renewed while it runs (even past their
    TTL) and then handed back, not left to expire; each turn still takes effect once."""
    slow_s = max(HOLD_S, ttl) + 0.5
    executor = SlowFirst(slow_s)
    store, transport, worker = make(
        executor, concurrency=1, ttl=ttl, renew=ttl / 4, AGENT_DISPATCH_CLAIM_BATCH=8
    )
    worker._turn_s = 0.0  # turns known to be short: the first claim is a batch
    slow = enqueue(store, transport, session_id="slow", payload=b'{"slow": true}')
    quick = [enqueue(store, transport, session_id=f"q{i}").id for i in range(5)]
    worker.start()
    running.append(worker)
    ids = [slow.id, *quick]
    wait_for(
        lambda: all(s is WorkState.SUCCEEDED for s in states(store, ids)), timeout=30, what="all succeed"
    )
    assert sorted(j for j, _ in executor.effects) == sorted(ids)
    for item_id in quick:
        events = [r.event for r in store.outcomes(item_id)]
        # Handed back with a live lease (a defer), never reclaimed after an expiry.
        assert events[:4] == ["submit", "claim", "running", "defer"], (item_id, events)
        assert not any(r.detail and "expired" in r.detail for r in store.outcomes(item_id))


def test_a_busy_session_is_handed_back_and_runs_later(running: list[Worker]) -> None:
    recorder = Recorder()
    store, transport, worker = make(recorder, concurrency=1, AGENT_DISPATCH_CLAIM_BATCH=8)
    worker._turn_s = 0.0
    busy = [enqueue(store, transport, session_id="busy").id for _ in range(2)]
    free = [enqueue(store, transport, session_id=f"f{i}").id for i in range(3)]
    release = threading.Event()
    held = threading.Event()

    def hold_session() -> None:
        with session_execution_guard("busy", timeout_s=5):
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_session)
    holder.start()
    held.wait(5)
    worker.start()
    running.append(worker)
    try:
        wait_for(lambda: all(s is WorkState.SUCCEEDED for s in states(store, free)), what="free sessions run")
        assert not any(s is WorkState.SUCCEEDED for s in states(store, busy))
    finally:
        release.set()
        holder.join()
    wait_for(lambda: all(s is WorkState.SUCCEEDED for s in states(store, busy)), what="busy session runs")
    assert recorder.overlaps == 0
    assert sorted(j for j, _ in recorder.effects) == sorted(busy + free)


@given(
    turn_s=st.none() | st.floats(0.0, 10.0, allow_nan=False),
    later_s=st.floats(0.0, 10.0, allow_nan=False),
    claim_batch=st.integers(1, 256),
    payload=st.floats(0.0, 64 * 1024 * 1024, allow_nan=False),
    larger=st.floats(0.0, 64 * 1024 * 1024, allow_nan=False),
)
def test_a_claim_asks_for_at_most_a_batch_of_work(
    turn_s: float | None, later_s: float, claim_batch: int, payload: float, larger: float
) -> None:
    size = claim_size(turn_s, claim_batch, payload)
    assert 1 <= size <= claim_batch
    if turn_s is None or turn_s >= SHORT_TURN_S:
        assert size == 1  # long or unmeasured turns: one at a time
        return
    # The batch's expected work and payload bytes stay within their bounds (a batch of one may
    # pass them); the fastest turns with small payloads fill claim_batch.
    assert size == 1 or (size * turn_s <= BATCH_WORK_S and size * payload <= BATCH_PAYLOAD_BYTES)
    margin = 1 - 1e-9  # float rounding
    if (
        turn_s * claim_batch < BATCH_WORK_S * margin
        and max(payload, 1) * claim_batch < BATCH_PAYLOAD_BYTES * margin
    ):
        assert size == claim_batch
    # Slower turns or larger payloads never get a larger batch.
    assert claim_size(max(turn_s, later_s), claim_batch, payload) <= size
    assert claim_size(turn_s, claim_batch, max(payload, larger)) <= size


def test_large_payloads_shrink_the_next_claims_at_once() -> None:
    _, _, worker = make(Recorder(), concurrency=1)
    assert worker.batch_size == 1  # no turn measured yet
    worker.observe_turn(0.0001, 100)
    assert worker.batch_size == worker.settings.claim_batch == 64
    worker.observe_turn(0.0001, 1024 * 1024)
    assert worker.batch_size == BATCH_PAYLOAD_BYTES // (1024 * 1024) == 16
    for _ in range(50):  # small payloads again: the batch grows back
        worker.observe_turn(0.0001, 100)
    assert worker.batch_size == 64
