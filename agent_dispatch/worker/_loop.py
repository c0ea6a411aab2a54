"""The fenced claim -> execute -> commit -> acknowledge loop.

Acknowledgement happens only after a durable fenced commit (invariant 5). Every other path
either releases the delivery for redelivery or acknowledges a delivery whose WorkItem is
already settled; nothing is acknowledged and dropped while its WorkItem still needs work.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent_dispatch.envelope import AgentTurnEnvelope, open_envelope, peek_job_id
from agent_dispatch.errors import (
    BackendUnavailable,
    Cancelled,
    DispatchError,
    Fenced,
    InvalidTransition,
    LeaseExpired,
    LeaseHeld,
    LeaseLost,
    NotFound,
    PoisonEnvelope,
)
from agent_dispatch.lease import LeaseRenewer, SessionHold, WorkItemLeaseGuard, session_execution_guard
from agent_dispatch.models import Lease, Outcome, WorkItem, WorkState
from agent_dispatch.settings import Settings
from agent_dispatch.store import WorkItemStore
from agent_dispatch.transport import AckMany, Delivery, Transport, WakesClaims
from agent_dispatch.worker import _metrics as m
from agent_dispatch.worker._batch import BUSY_DELAY_S, Batch, InFlight
from agent_dispatch.worker._executors import Executor, TurnFailed, run_executor
from agent_dispatch.worker._release import Committer

log = logging.getLogger("agent_dispatch.worker")

#: Turns shorter than this (a moving average) are claimed in batches (:func:`claim_size`).
SHORT_TURN_S = 0.05
#: A batch holds about this much work at the observed turn time: what a batch of 16 turns just
#: under ``SHORT_TURN_S`` held when 16 was a fixed size. Faster turns get larger batches, up to
#: ``claim_batch``, so their round trips are shared more widely; slower ones get smaller batches,
#: so a claimer never keeps more claimed turns waiting behind the one it runs than that.
BATCH_WORK_S = 0.8
#: And about this many payload bytes at the observed payload size (a batch's payloads are read
#: at once): what a batch of 16 could hold at the default 1 MiB payload limit, so a worker's
#: memory does not grow with ``claim_batch`` when its payloads are large.
BATCH_PAYLOAD_BYTES = 16 * 1024 * 1024


def claim_size(turn_s: float | None, claim_batch: int, payload_bytes: float = 0.0) -> int:
    """How many deliveries one claim asks for, given the moving averages of turn time (``None``
    before the first turn) and payload size: one while turns are long or unknown, else as many
    as fit in :data:`BATCH_WORK_S` and :data:`BATCH_PAYLOAD_BYTES`, between 1 and ``claim_batch``."""
    if turn_s is None or turn_s >= SHORT_TURN_S:
        return 1
    fit = min(BATCH_WORK_S / max(turn_s, 1e-9), BATCH_PAYLOAD_BYTES / max(payload_bytes, 1.0))
    return max(1, min(claim_batch, int(fit)))


@dataclass
class WorkerState:
    """What the health endpoints and the heartbeat report."""

    started_at: float = field(default_factory=time.time)
    last_loop_at: float = 0.0
    draining: bool = False
    ready: bool = False


class Worker:
    """Runs ``concurrency`` claim loops over one store and one transport."""

    def __init__(
        self,
        settings: Settings,
        store: WorkItemStore,
        transport: Transport,
        executor: Executor,
        *,
        signing_key: bytes,
        concurrency: int | None = None,
        worker_id: str | None = None,
        session_connect: Callable[[], Any] | None = None,
        redrive: Callable[[], int] | None = None,
        on_stopped: Callable[[], None] | None = None,
    ) -> None:
        """``on_stopped`` runs once :meth:`stop` is done: it closes what the assembly opened for
        this worker alone (the session locks' connections)."""
        self.settings = settings
        self.store = store
        self.transport = transport
        self.executor = executor
        self.signing_key = signing_key
        self.concurrency = concurrency or settings.concurrency
        self.worker_id = worker_id or settings.worker_id or f"w-{uuid.uuid4().hex[:10]}"
        self.session_connect = session_connect
        self.redrive = redrive
        self._on_stopped = on_stopped
        self.state = WorkerState()
        self._stop_claiming = threading.Event()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._in_flight: dict[str, InFlight] = {}
        self._in_flight_lock = threading.Lock()
        # Unknown until a turn has run: claim one at a time until turns prove short.
        self._turn_s: float | None = None
        self._payload_bytes = 0.0
        self.renewer = LeaseRenewer(f"lease-renewer-{self.worker_id}")
        self.committer = Committer(store, transport, signing_key=signing_key)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        for index in range(self.concurrency):
            owner = f"{self.worker_id}/{index}"
            thread = threading.Thread(
                target=self._claim_loop, args=(owner,), name=f"worker-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        sweeper = threading.Thread(target=self._sweep_loop, name="recovery-sweep", daemon=True)
        sweeper.start()
        self._threads.append(sweeper)
        self.state.ready = True
        log.info("worker started", extra={"worker_id": self.worker_id, "concurrency": self.concurrency})

    def stop(self, grace_s: float | None = None) -> None:
        """Stop claiming; let running turns finish within the grace period, then release them."""
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        self.state.draining = True
        self.state.ready = False
        self._stop_claiming.set()
        if isinstance(self.transport, WakesClaims):
            self.transport.wake_claims()  # the loops waiting in a claim see the stop now
        deadline = time.monotonic() + grace
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._in_flight_lock:
            leftovers = list(self._in_flight.values())
        for flight in leftovers:
            self._hand_back(flight)
        self._stopped.set()
        for thread in self._threads:
            thread.join(timeout=1.0)
        self.renewer.close()
        if self._on_stopped is not None:
            self._on_stopped()
        log.info("worker stopped", extra={"worker_id": self.worker_id, "released": len(leftovers)})

    def _hand_back(self, flight: InFlight) -> None:
        """Shutdown past the grace period: release the lease and delivery so another worker takes over now."""
        if flight.guard is not None:
            flight.guard.revoke("released at shutdown")
        if flight.lease is not None:
            with contextlib.suppress(DispatchError):
                self.store.defer(flight.guard.lease if flight.guard else flight.lease)
        with contextlib.suppress(DispatchError):
            self.transport.release(flight.delivery.receipt, delay_s=0)

    # --- loops ---------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Batches while turns are short, one at a time while they are long (or unknown), so a
        long turn never keeps other claimed turns waiting behind it (:func:`claim_size`)."""
        return claim_size(self._turn_s, self.settings.claim_batch, self._payload_bytes)

    def observe_turn(self, seconds: float, payload_bytes: int) -> None:
        previous = self._turn_s
        self._turn_s = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        # The payload estimate rises at once to a larger payload and falls back gradually: the
        # next claims shrink as soon as large payloads appear.
        estimate = 0.8 * self._payload_bytes + 0.2 * payload_bytes
        self._payload_bytes = float(payload_bytes) if previous is None else max(estimate, payload_bytes)

    def _claim_loop(self, owner: str) -> None:
        while not self._stop_claiming.is_set():
            self.state.last_loop_at = time.time()
            m.HEARTBEAT.set(self.state.last_loop_at)
            try:
                started = time.perf_counter()
                deliveries = self.transport.claim(owner, max_items=self.batch_size, wait_s=1.0)
                if deliveries:
                    m.CLAIM_SECONDS.observe(time.perf_counter() - started)
            except Exception:
                log.warning("transport claim failed; backing off", exc_info=True)
                self._stop_claiming.wait(1.0)
                continue
            if self._stop_claiming.is_set():
                for delivery in deliveries:
                    self.release(delivery, 0.0)
                continue
            if deliveries:
                self._handle_batch(owner, deliveries)

    def _handle_batch(self, owner: str, deliveries: list[Delivery]) -> None:
        flights = [InFlight(delivery) for delivery in deliveries]
        with self._in_flight_lock:
            for flight in flights:
                self._in_flight[flight.delivery.receipt.token] = flight
        m.IN_FLIGHT.inc(len(flights))
        try:
            Batch(self, owner, flights).run()
        except Exception:
            # Never crash the loop on one batch; what it did not settle is redelivered.
            log.exception("unexpected error handling a batch", extra={"deliveries": len(deliveries)})
            for flight in flights:
                with contextlib.suppress(Exception):
                    self.transport.release(flight.delivery.receipt, delay_s=BUSY_DELAY_S)
        finally:
            m.IN_FLIGHT.dec(len(flights))
            with self._in_flight_lock:
                for flight in flights:
                    self._in_flight.pop(flight.delivery.receipt.token, None)

    # --- what a Batch uses (BatchHost) ----------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """Whether the worker stopped claiming (a batch hands its waiting turns back)."""
        return self._stop_claiming.is_set()

    def handle_one(self, owner: str, flight: InFlight) -> None:
        """The one-by-one path, for what a batch leaves out."""
        try:
            self.handle(owner, flight.delivery, flight)
        except Exception:
            log.exception(
                "unexpected error handling a delivery", extra={"work_item_id": flight.delivery.work_item_id}
            )
            with contextlib.suppress(Exception):
                self.transport.release(flight.delivery.receipt, delay_s=BUSY_DELAY_S)

    def _sweep_loop(self) -> None:
        interval = self.settings.sweep_interval_s
        while not self._stopped.wait(interval):
            try:
                if not self.store.try_lead("recovery-sweep"):
                    continue
                for item in self.store.expire():
                    m.TURNS.labels("expired").inc()
                    log.info("deadline expired", extra={"job_id": item.id})
                if self.redrive is not None:
                    self.redrive()
            except Exception:
                log.warning("recovery sweep failed", exc_info=True)

    # --- one delivery --------------------------------------------------------------------------

    def handle(self, owner: str, delivery: Delivery, flight: InFlight | None = None) -> str:
        """Process one delivery; returns what happened (for tests and logs)."""
        flight = flight or InFlight(delivery)
        try:
            envelope = open_envelope(delivery.wire, self.signing_key)
            item = self.store.get(envelope.job_id)
            if item.tenant != envelope.tenant:
                raise PoisonEnvelope("envelope tenant does not own its WorkItem")
        except (PoisonEnvelope, NotFound) as exc:
            return self.poison(delivery, str(exc))

        if item.terminal or item.state is WorkState.SUBMITTED:
            # Settled already (a duplicate delivery), or waiting on dependencies: the store
            # re-drives it when it becomes ready, so this delivery carries nothing.
            self._ack(delivery)
            return f"skipped-{item.state.value}"
        # The authority's clock costs a round trip: ask it only when there is a deadline to check.
        if envelope.deadline is not None and envelope.expired(self.store.now()):
            return self._expire(delivery, item)
        if item.not_before is not None and item.state is WorkState.READY:
            wait = (item.not_before - self.store.now()).total_seconds()
            if wait > 0:
                self.release(delivery, wait)
                return "not-yet-due"

        try:
            lease = self.store.claim(owner, work_item_id=item.id, ttl_s=self.settings.claim_ttl_s)
        except LeaseHeld:
            self.release(delivery, BUSY_DELAY_S)
            return "busy"
        except InvalidTransition:
            self._ack(delivery)
            return "skipped"
        if lease is None:  # attempts spent: the store dead-lettered it
            m.TURNS.labels("dead_letter").inc()
            self._ack(delivery)
            return "dead_letter"
        flight.lease = lease
        try:
            with session_execution_guard(
                item.session_id,
                timeout_s=self.settings.claim_ttl_s / 2,
                connect=self.session_connect,
                idle_timeout_s=self.settings.claim_ttl_s,
            ) as hold:
                return self._run(delivery, envelope, lease, flight, hold)
        except LeaseHeld:
            # The session is busy elsewhere: hand the lease back without spending an attempt.
            with contextlib.suppress(LeaseLost):
                self.store.defer(flight.lease or lease)
            self.release(delivery, BUSY_DELAY_S)
            return "session-busy"

    def _run(
        self,
        delivery: Delivery,
        envelope: AgentTurnEnvelope,
        lease: Lease,
        flight: InFlight,
        hold: SessionHold,
    ) -> str:
        try:
            lease = self.store.mark_running(lease)
            flight.lease = lease
            payload = self.store.get_payload(envelope.job_id, tenant=envelope.tenant)

            def on_renew() -> None:
                m.LEASE_RENEWALS.inc()
                hold.keepalive()

            guard = WorkItemLeaseGuard(
                self.store,
                lease,
                ttl_s=self.settings.claim_ttl_s,
                interval_s=self.settings.effective_renew_interval_s,
                on_renew=on_renew,
                renewer=self.renewer,
            )
            flight.guard = guard
            started = time.perf_counter()
            with guard:
                failure = run_executor(self.executor, envelope, payload, guard, log)
            elapsed = time.perf_counter() - started
            m.EXECUTE_SECONDS.observe(elapsed)
            self.observe_turn(elapsed, len(payload))
            return self.commit(delivery, guard.lease, failure)
        except LeaseLost as exc:
            return self.lease_lost(delivery, exc)

    def commit(self, delivery: Delivery, lease: Lease, failure: TurnFailed | None) -> str:
        started = time.perf_counter()
        if failure is None:
            self._commit_durably(lease, Outcome.SUCCEEDED)
            outcome = "succeeded"
        elif failure.retryable:
            item = self.store.retry(lease, error=str(failure))
            if item.state is WorkState.DEAD_LETTER:
                outcome = "dead_letter"
            else:
                # The same delivery comes back when the backoff is over; the store is the authority.
                m.TURNS.labels("retried").inc()
                delay = (item.not_before - self.store.now()).total_seconds() if item.not_before else 0.0
                self.release(delivery, max(delay, 0.0))
                return "retried"
        else:
            self._commit_durably(lease, Outcome.FAILED, error=str(failure))
            outcome = "failed"
        # Counted once the commit is durable, whatever happens to the acknowledgement: a failed
        # ack only means the delivery comes back and is settled as a duplicate.
        m.TURNS.labels(outcome).inc()
        self._ack(delivery)
        m.COMMIT_SECONDS.observe(time.perf_counter() - started)
        return outcome

    def _commit_durably(self, lease: Lease, outcome: Outcome, *, error: str | None = None) -> None:
        """Commit, dispatching the dependents it releases (:class:`Committer`); when the database
        drops the connection mid-commit (a restart), the outcome is unknown, so ask again: a fenced
        commit is idempotent per lease, and a repeat reports whether the first one had applied.
        Fencing errors are answers, not doubts: they propagate."""
        for attempt in range(3):
            try:
                self.committer.commit(lease, outcome, error=error)
                return
            except Exception as exc:
                # Fencing errors are answers; an unreachable store or an unclassified driver
                # error leaves the outcome unknown.
                if isinstance(exc, DispatchError) and not isinstance(exc, BackendUnavailable):
                    raise
                if attempt == 2:
                    raise BackendUnavailable("commit outcome unknown after 3 attempts") from exc
                log.warning(
                    "commit outcome unknown; asking again",
                    extra={"work_item_id": lease.work_item_id, "error": type(exc).__name__},
                )
            self._stop_claiming.wait(0.5 * (attempt + 1))

    def lease_lost(self, delivery: Delivery, exc: LeaseLost) -> str:
        reason = (
            "cancelled"
            if isinstance(exc, Cancelled)
            else "expired"
            if isinstance(exc, LeaseExpired)
            else "fenced"
        )
        m.LEASE_FAILURES.labels(reason).inc()
        log.warning("lease lost", extra={"work_item_id": delivery.work_item_id, "reason": reason})
        if isinstance(exc, Cancelled):
            # Cancellation is terminal in the authority: this delivery has nothing left to do.
            m.TURNS.labels("cancelled").inc()
            self._ack(delivery)
            return "cancelled"
        # Fenced or expired: never acknowledge; the delivery comes back and the authority decides.
        m.TURNS.labels("fenced").inc()
        self.release(delivery, BUSY_DELAY_S)
        return "fenced"

    def _expire(self, delivery: Delivery, item: WorkItem) -> str:
        with contextlib.suppress(InvalidTransition):
            self.store.cancel(item.id, tenant=item.tenant, reason="deadline expired")
        m.TURNS.labels("expired").inc()
        self._ack(delivery)
        return "expired"

    def poison(self, delivery: Delivery, reason: str) -> str:
        # A poison envelope never touches a WorkItem (a forgery could name a real one): it is
        # recorded and acknowledged, and the worker carries on.
        m.TURNS.labels("poison").inc()
        log.error(
            "poison envelope dead-lettered",
            extra={
                "reason": reason,
                "claimed_job_id": peek_job_id(delivery.wire),
                "size": len(delivery.wire),
            },
        )
        self._ack(delivery)
        return "poison"

    def ack_many(self, deliveries: list[Delivery]) -> None:
        if not isinstance(self.transport, AckMany) or len(deliveries) < 2:
            for delivery in deliveries:
                self._ack(delivery)
            return
        for receipt in self.transport.ack_many([d.receipt for d in deliveries]):
            log.info("stale receipt; delivery already reassigned", extra={"receipt_owner": receipt.owner})

    def _ack(self, delivery: Delivery) -> None:
        try:
            self.transport.ack(delivery.receipt)
        except Fenced:
            # Our visibility claim was reassigned; the newer delivery settles against the authority.
            log.info(
                "stale receipt; delivery already reassigned", extra={"work_item_id": delivery.work_item_id}
            )

    def release(self, delivery: Delivery, delay_s: float) -> None:
        with contextlib.suppress(Fenced):
            self.transport.release(delivery.receipt, delay_s=delay_s)
