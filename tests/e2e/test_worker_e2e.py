"""agent-dispatch-worker processes on real PostgreSQL, Kafka and SQLite (issue: the worker loop)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_dispatch.envelope import AgentTurnEnvelope, seal
from agent_dispatch.models import SubmitRequest, WorkState
from agent_dispatch.transport import OutboundTurn
from tests.e2e.harness import (
    KEY,
    Backend,
    backend_env,
    start_worker,
    stop_all,
    submit,
    wait_states,
    wait_until,
)
from tests.e2e.sink import FencingSink

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("kafka", id="kafka", marks=[pytest.mark.kafka, pytest.mark.postgres]),
]
TERMINAL = {WorkState.SUCCEEDED, WorkState.FAILED, WorkState.CANCELLED, WorkState.DEAD_LETTER}


@pytest.fixture
def sink() -> Iterator[FencingSink]:
    server = FencingSink().start()
    yield server
    server.stop()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    chosen = backend_env(request.param, tmp_path, request)
    yield chosen
    stop_all(chosen)


def succeeded_commits(store: object, item_id: str) -> int:
    records = store.outcomes(item_id)  # type: ignore[attr-defined]
    return sum(1 for r in records if r.event == "commit" and r.outcome == "succeeded")


def test_thousand_turns_two_workers_each_succeeds_exactly_once(
    backend: Backend, sink: FencingSink, tmp_path: Path
) -> None:
    settings, store, transport = backend.open()
    for n in range(2):
        start_worker(backend, sink_url=sink.url, log=tmp_path / f"worker{n}.log")
    items = submit(settings, store, transport, 1000, session=lambda i: f"s{i % 97}")
    ids = [i.id for i in items]
    settled = wait_states(store, ids, TERMINAL, timeout=240)
    assert {s.state for s in settled.values()} == {WorkState.SUCCEEDED}
    assert all(len(sink.accepted[i]) == 1 for i in ids), "each turn's side effect accepted exactly once"
    assert all(succeeded_commits(store, i) == 1 for i in ids[:100])
    wait_until(lambda: transport.depth() == 0, 60, "every delivery acknowledged")


def test_sigstop_past_ttl_loses_the_lease_and_is_refused_after_sigcont(
    backend: Backend, sink: FencingSink, tmp_path: Path
) -> None:
    settings, store, transport = backend.open()
    paused = start_worker(backend, sink_url=sink.url, concurrency=1, log=tmp_path / "paused.log")
    [item] = submit(settings, store, transport, 1, payload=json.dumps({"sleep_s": 4}).encode())
    wait_states(store, [item.id], {WorkState.RUNNING}, timeout=30, what="the turn starts")
    stale_token = store.get(item.id).fencing_token
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        start_worker(backend, sink_url=sink.url, concurrency=1, log=tmp_path / "rescuer.log")
        done = wait_states(
            store, [item.id], {WorkState.SUCCEEDED}, timeout=90, what="another worker completes"
        )
        assert done[item.id].fencing_token > stale_token
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    time.sleep(6)  # let the resumed worker reach its side effect and commit, and be refused
    assert sink.accepted[item.id] == [done[item.id].fencing_token]
    assert stale_token not in sink.accepted[item.id]
    assert succeeded_commits(store, item.id) == 1
    assert store.get(item.id).state is WorkState.SUCCEEDED
    assert paused.poll() is None, "the paused worker keeps serving after being fenced"


def test_sigkill_during_a_turn_completes_elsewhere_within_ttl_plus_sweep(
    backend: Backend, sink: FencingSink, tmp_path: Path
) -> None:
    settings, store, transport = backend.open()
    victim = start_worker(backend, sink_url=sink.url, concurrency=1, log=tmp_path / "victim.log")
    [item] = submit(settings, store, transport, 1, payload=json.dumps({"sleep_s": 3}).encode())
    wait_states(store, [item.id], {WorkState.RUNNING}, timeout=30, what="the turn starts")
    victim.kill()
    killed_at = time.monotonic()
    start_worker(backend, sink_url=sink.url, concurrency=1, log=tmp_path / "rescuer.log")
    done = wait_states(store, [item.id], {WorkState.SUCCEEDED}, timeout=90, what="completed elsewhere")
    took = time.monotonic() - killed_at
    # Recovery: the lease expires (TTL), the delivery becomes visible again or the sweep re-drives it.
    bound = max(settings.claim_ttl_s, settings.effective_visibility_timeout_s) + settings.sweep_interval_s
    assert took <= bound + 3 + 5, f"completed {took:.1f}s after the kill; bound {bound:.0f}s + 3s turn"
    assert done[item.id].lease_epoch >= 2
    assert sink.accepted[item.id] == [done[item.id].fencing_token]


@pytest.mark.parametrize("backend", [BACKENDS[0], BACKENDS[1]], indirect=True)
def test_poison_forged_unsigned_and_orphan_envelopes_are_dead_lettered(
    backend: Backend, sink: FencingSink, tmp_path: Path
) -> None:
    settings, store, transport = backend.open()
    orphan = AgentTurnEnvelope(
        job_id="no-such-item",
        session_id="s",
        kind="turn",
        payload_ref="x",
        tenant="acme",
        enqueued_at=time.time(),
    )
    [victim] = submit(settings, store, transport, 1)  # a real item a forgery names
    forged_env = AgentTurnEnvelope(
        job_id=victim.id,
        session_id="s",
        kind="turn",
        payload_ref=victim.id,
        tenant="acme",
        enqueued_at=time.time(),
    )
    bad = {
        "malformed": b"\x00\xff not json",
        "unsigned": json.dumps({"v": 1, "env": orphan.model_dump(), "sig": ""}).encode(),
        "forged": seal(forged_env, b"z" * 40),
        "orphan": seal(orphan, KEY.encode()),
    }
    transport.admit([OutboundTurn(f"poison-{name}", f"p-{name}", "acme", wire) for name, wire in bad.items()])
    start_worker(backend, sink_url=sink.url, concurrency=2, log=tmp_path / "worker.log")
    good = submit(settings, store, transport, 5)
    wait_states(store, [victim.id, *(g.id for g in good)], {WorkState.SUCCEEDED}, timeout=60)
    wait_until(lambda: transport.depth() == 0, 30, "poison acknowledged")
    assert len(sink.accepted[victim.id]) == 1, "the forgery never ran the real item"
    assert "no-such-item" not in sink.accepted


@pytest.mark.parametrize("backend", [BACKENDS[0], BACKENDS[1]], indirect=True)
def test_expired_envelope_cancels_and_never_executes(
    backend: Backend, sink: FencingSink, tmp_path: Path
) -> None:
    _settings, store, transport = backend.open()
    item = store.submit(SubmitRequest(tenant="acme", kind="turn", payload=b"{}")).item
    envelope = AgentTurnEnvelope(
        job_id=item.id,
        session_id=item.session_id,
        kind="turn",
        payload_ref=item.id,
        tenant="acme",
        deadline=time.time() - 1,
        enqueued_at=time.time() - 2,
    )
    transport.admit([OutboundTurn(item.id, item.session_id, "acme", seal(envelope, KEY.encode()))])
    start_worker(backend, sink_url=sink.url, concurrency=1, log=tmp_path / "worker.log")
    wait_states(store, [item.id], {WorkState.CANCELLED}, timeout=30)
    wait_until(lambda: transport.depth() == 0, 30, "acknowledged")
    assert item.id not in sink.accepted


@pytest.mark.parametrize("backend", [BACKENDS[1], BACKENDS[2]], indirect=True)
def test_two_workers_one_session_never_overlap(backend: Backend, sink: FencingSink, tmp_path: Path) -> None:
    settings, store, transport = backend.open()
    timeline = tmp_path / "timeline.jsonl"
    for n in range(2):
        start_worker(
            backend,
            sink_url=sink.url,
            concurrency=2,
            log=tmp_path / f"w{n}.log",
            extra={"AGENT_DISPATCH_TEST_TIMELINE": str(timeline)},
        )
    items = submit(
        settings,
        store,
        transport,
        12,
        payload=json.dumps({"sleep_s": 0.15}).encode(),
        session=lambda i: "one",
    )
    wait_states(store, [i.id for i in items], {WorkState.SUCCEEDED}, timeout=120)
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    spans: dict[str, list[float]] = {}
    for event in events:
        spans.setdefault(event["job"], []).append(event["t"])
    intervals = sorted((min(ts), max(ts)) for ts in spans.values())
    assert len(intervals) == 12
    for (_, end), (start, _) in itertools.pairwise(intervals):
        assert start >= end, "two turns of one session overlapped"


@pytest.mark.parametrize("backend", [BACKENDS[0], BACKENDS[1]], indirect=True)
def test_sigterm_finishes_within_grace_or_hands_back(
    backend: Backend, sink: FencingSink, tmp_path: Path
) -> None:
    settings, store, transport = backend.open()
    draining = start_worker(backend, sink_url=sink.url, concurrency=2, log=tmp_path / "draining.log")
    short, long = submit(settings, store, transport, 2, session=lambda i: f"sess-{i}", payload=b"{}")
    wait_states(store, [short.id, long.id], {WorkState.SUCCEEDED}, timeout=30)
    [finishing] = submit(settings, store, transport, 1, payload=json.dumps({"sleep_s": 2}).encode())
    [too_long] = submit(settings, store, transport, 1, payload=json.dumps({"sleep_s": 60}).encode())
    wait_states(store, [finishing.id, too_long.id], {WorkState.RUNNING}, timeout=30, what="both running")
    draining.send_signal(signal.SIGTERM)
    assert draining.wait(timeout=20) == 0
    assert store.get(finishing.id).state is WorkState.SUCCEEDED, "finished within the grace period"
    handed_back = store.get(too_long.id)
    assert handed_back.state is WorkState.READY, "released past the grace period"
    # Another worker takes the released turn over at once (its lease and delivery were handed back).
    start_worker(backend, sink_url=sink.url, concurrency=1, log=tmp_path / "next.log")
    wait_states(store, [too_long.id], {WorkState.RUNNING}, timeout=15, what="taken over")
