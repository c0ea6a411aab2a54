"""A claimed batch of deliveries, run one after another under one set of round trips.

A no-op turn costs about a dozen round trips when handled alone (claim, read, lease, start,
payload, session lock and unlock, commit, acknowledge). A batch shares them: one
``WorkItemStore.start_many`` leases, starts and reads every simply claimable turn, one statement
takes every session lock, and the outcomes are committed with one ``commit_many`` and
acknowledged with one ``ack_many`` once the batch is done. Everything else (poison, duplicates,
spent attempts, deadlines, busy items) takes the one-by-one path of :meth:`Worker.handle`.

What keeps a batch safe when a turn turns out long: the running turn's lease renewals also renew
every lease the batch still holds (waiting turns and outcomes not yet committed), and after any
turn longer than :data:`HOLD_S` the batch commits what it has and hands its waiting turns back
for other workers instead of making them wait.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from agent_dispatch.envelope import AgentTurnEnvelope, open_envelope
from agent_dispatch.errors import DispatchError, LeaseLost, PoisonEnvelope
from agent_dispatch.lease import LeaseRenewer, SessionHold, WorkItemLeaseGuard, session_batch_guard
from agent_dispatch.models import Lease, Outcome
from agent_dispatch.settings import Settings
from agent_dispatch.store import WorkItemStore
from agent_dispatch.transport import Delivery
from agent_dispatch.worker import _metrics as m
from agent_dispatch.worker._executors import Executor, TurnFailed, run_executor

log = logging.getLogger("agent_dispatch.worker")

#: A turn longer than this ends the batch early: outcomes are committed, waiting turns handed back.
HOLD_S = 1.0
#: How long a delivery whose WorkItem or session is busy elsewhere waits before it comes back.
BUSY_DELAY_S = 1.0


@dataclass
class InFlight:
    """One claimed delivery while a claim loop holds it (what shutdown hands back)."""

    delivery: Delivery
    lease: Lease | None = None
    guard: WorkItemLeaseGuard | None = None


class BatchHost(Protocol):
    """What a batch needs of its worker: its parts, and the one-by-one steps it falls back to."""

    settings: Settings
    store: WorkItemStore
    executor: Executor
    signing_key: bytes
    session_connect: Callable[[], Any] | None
    renewer: LeaseRenewer

    @property
    def stopping(self) -> bool: ...

    def handle_one(self, owner: str, flight: InFlight) -> None: ...

    def poison(self, delivery: Delivery, reason: str) -> str: ...

    def lease_lost(self, delivery: Delivery, exc: LeaseLost) -> str: ...

    def observe_turn(self, seconds: float, payload_bytes: int) -> None: ...

    def commit(self, delivery: Delivery, lease: Lease, failure: TurnFailed | None) -> str: ...

    def ack_many(self, deliveries: list[Delivery]) -> None: ...

    def release(self, delivery: Delivery, delay_s: float) -> None: ...


@dataclass
class _Turn:
    delivery: Delivery
    envelope: AgentTurnEnvelope
    flight: InFlight
    lease: Lease
    payload: bytes
    outcome: Outcome | None = None
    error: str | None = None
    done: bool = False
    lost: LeaseLost | None = None


class Batch:
    """One claim loop's batch; lives for one pass of :meth:`run`."""

    def __init__(self, worker: BatchHost, owner: str, flights: list[InFlight]) -> None:
        self.worker = worker
        self.owner = owner
        self.flights = flights
        self._lock = threading.Lock()
        self._held: list[_Turn] = []  # leases this batch holds beyond the running turn

    # --- the pass ------------------------------------------------------------------------------

    def run(self) -> None:
        w = self.worker
        opened: list[tuple[InFlight, AgentTurnEnvelope]] = []
        for flight in self.flights:
            try:
                opened.append((flight, open_envelope(flight.delivery.wire, w.signing_key)))
            except PoisonEnvelope as exc:
                w.poison(flight.delivery, str(exc))
        # start_many checks the WorkItem's deadline by the store's clock; an envelope that looks
        # expired here goes one by one, where its own deadline is checked against that clock.
        now = time.time()
        fresh = [env for _, env in opened if env.deadline is None or env.deadline > now]
        started = (
            w.store.start_many(
                self.owner, [(env.job_id, env.tenant) for env in fresh], ttl_s=w.settings.claim_ttl_s
            )
            if fresh
            else {}
        )
        turns: list[_Turn] = []
        one_by_one: list[InFlight] = []
        for flight, env in opened:
            turn = started.pop(env.job_id, None)  # a duplicate delivery in the batch goes one by one
            if turn is None:
                one_by_one.append(flight)
                continue
            flight.lease = turn.lease
            turns.append(_Turn(flight.delivery, env, flight, turn.lease, turn.payload))
        if turns:
            self._run_started(turns)
        for flight in one_by_one:
            w.handle_one(self.owner, flight)

    def _run_started(self, turns: list[_Turn]) -> None:
        w = self.worker
        with session_batch_guard(
            (t.envelope.session_id for t in turns),
            connect=w.session_connect,
            idle_timeout_s=w.settings.claim_ttl_s,
        ) as (hold, sessions):
            with self._lock:
                self._held = list(turns)
            try:
                for index, turn in enumerate(turns):
                    if w.stopping:
                        self._hand_back(turns[index:], "worker stopping")
                        break
                    if turn.envelope.session_id not in sessions:
                        self._hand_back([turn], "session busy")
                        continue
                    if turn.lost is not None:
                        self._finish(turn)
                        w.lease_lost(turn.delivery, turn.lost)
                        continue
                    started = time.monotonic()
                    self._execute(turn, hold)
                    if time.monotonic() - started > HOLD_S:
                        self._settle(turns[: index + 1])
                        self._hand_back(turns[index + 1 :], "batch held too long")
                        break
            finally:
                self._settle(turns)

    # --- one turn ------------------------------------------------------------------------------

    def _execute(self, turn: _Turn, hold: SessionHold) -> None:
        w = self.worker

        def on_renew() -> None:
            m.LEASE_RENEWALS.inc()
            hold.keepalive()
            self._renew_held(turn)

        guard = WorkItemLeaseGuard(
            w.store,
            turn.lease,
            ttl_s=w.settings.claim_ttl_s,
            interval_s=w.settings.effective_renew_interval_s,
            on_renew=on_renew,
            renewer=w.renewer,
        )
        turn.flight.guard = guard
        started = time.perf_counter()
        try:
            with guard:
                failure = run_executor(w.executor, turn.envelope, turn.payload, guard, log)
        except LeaseLost as exc:
            self._finish(turn)
            w.lease_lost(turn.delivery, exc)
            return
        elapsed = time.perf_counter() - started
        m.EXECUTE_SECONDS.observe(elapsed)
        w.observe_turn(elapsed, len(turn.payload))
        turn.lease = guard.lease
        if failure is not None and failure.retryable:
            self._finish(turn)
            with contextlib.suppress(LeaseLost):
                w.commit(turn.delivery, turn.lease, failure)
            return
        turn.outcome = Outcome.SUCCEEDED if failure is None else Outcome.FAILED
        turn.error = None if failure is None else str(failure)

    # --- settling ------------------------------------------------------------------------------

    def _settle(self, turns: list[_Turn]) -> None:
        """Commit the executed turns in one statement and acknowledge them in one call; what the
        batch statement leaves out is committed one by one, which explains or raises."""
        w = self.worker
        ready = [t for t in turns if t.outcome is not None and not t.done]
        if not ready:
            return
        started = time.perf_counter()
        for turn in ready:
            self._finish(turn)
        try:
            committed = w.store.commit_many([(t.lease, t.outcome, t.error) for t in ready if t.outcome])
        except Exception:
            # Outcome unknown (e.g. a database restart): the one-by-one commit asks again, and a
            # fenced commit is idempotent per lease.
            log.warning("batch commit failed; committing one by one", exc_info=True)
            committed = {}
        to_ack: list[Delivery] = []
        for turn in ready:
            assert turn.outcome is not None
            if turn.lease.work_item_id in committed:
                m.TURNS.labels(turn.outcome.value).inc()
                to_ack.append(turn.delivery)
                continue
            failure = (
                None if turn.outcome is Outcome.SUCCEEDED else TurnFailed(turn.error or "", retryable=False)
            )
            try:
                w.commit(turn.delivery, turn.lease, failure)
            except LeaseLost as exc:
                w.lease_lost(turn.delivery, exc)
        w.ack_many(to_ack)
        m.COMMIT_SECONDS.observe(time.perf_counter() - started)

    def _hand_back(self, turns: list[_Turn], reason: str) -> None:
        w = self.worker
        for turn in turns:
            if turn.done or turn.outcome is not None:
                continue
            self._finish(turn)
            with contextlib.suppress(DispatchError):
                w.store.defer(turn.lease)
            w.release(turn.delivery, BUSY_DELAY_S if reason == "session busy" else 0.0)

    def _finish(self, turn: _Turn) -> None:
        with self._lock:
            turn.done = True
            self._held = [t for t in self._held if t is not turn]

    def _renew_held(self, running: _Turn) -> None:
        """Renew the other leases the batch holds while one of its turns runs long."""
        with self._lock:
            held = [t for t in self._held if t is not running and not t.done]
        for turn in held:
            try:
                turn.lease = self.worker.store.renew(turn.lease, ttl_s=self.worker.settings.claim_ttl_s)
                turn.flight.lease = turn.lease
            except LeaseLost as exc:
                # A waiting turn does not run; an executed one's commit is refused and explained.
                turn.lost = exc
                log.warning("held lease lost", extra={"work_item_id": turn.lease.work_item_id})
            except Exception:
                # Transient: the next renewal tries again; the expiry still protects.
                log.warning("renewal of a held lease failed", exc_info=True)
