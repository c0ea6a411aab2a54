"""Random interleavings of the WorkItem lifecycle against a simple model (Hypothesis stateful).

Workers claim (next or by name), run, renew, check before side effects, commit, retry and defer,
also in batches (start_many: claim + run; commit_many); some of them hold stale leases, some forge theirs (another tenant, owner, epoch or token); users
cancel; deadlines pass and the clock moves. After every step the store must agree with the
model, and the invariants hold: no call from a stale epoch or the wrong tenant is accepted,
terminal states never change, fencing tokens strictly increase, attempts never exceed the maximum.

Time: the memory store runs on a fake clock. SQLite and PostgreSQL keep their own database clock
and the test moves it with their explicit test hook (``set_clock_offset_for_tests``, an interval
added to the database's now in SQL); real time still passes, so the model brackets every call
with ``store.now()`` before and after and accepts exactly the outcomes possible in that window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from agent_dispatch.errors import (
    Cancelled,
    DispatchError,
    Fenced,
    InvalidTransition,
    LeaseExpired,
    LeaseHeld,
    NotFound,
    TenantMismatch,
)
from agent_dispatch.models import LEASED_STATES, Lease, Outcome, SubmitRequest, WorkItem, WorkState
from agent_dispatch.store import CountsUnfinished, WorkItemStore
from agent_dispatch.stores.memory import MemoryStore
from agent_dispatch.stores.postgres import PostgresStore
from agent_dispatch.stores.sqlite import SqliteStore
from tests.contract._store_harness import FakeClock, reset_postgres, store_settings

TTL = 60.0
MAX_ATTEMPTS = 3
DEADLINE_S = 110.0  # never a sum of clock steps (25, 61) apart from a claim: no exact ties
TENANTS = ("acme", "globex")
WORKERS = ("w1", "w2", "w3")
OPS = (
    "require_current",
    "renew",
    "mark_running",
    "commit_succeeded",
    "commit_failed",
    "commit_cancelled",
    "commit_retryable",
    "retry",
    "defer",
)
OK = "ok"
Expected = set[Any]  # possible results: OK, "repeat", or an error class


@dataclass
class Model:
    id: str
    tenant: str
    seq: int
    deadline: float | None
    state: WorkState = WorkState.READY
    epoch: int = 0
    token: int = 0
    owner: str | None = None
    attempt: int = 0
    expires: float | None = None
    not_before: float | None = None
    outcome: Outcome | None = None
    commit_token: int | None = None


def ts(value: Any) -> float | None:
    return None if value is None else float(value.timestamp())


class StoreMachine(RuleBasedStateMachine):
    """Bind ``open_store`` (returns the store, a clock mover and a cleanup) in a subclass."""

    open_store: ClassVar[Callable[[], tuple[WorkItemStore, Callable[[float], None], Callable[[], None]]]]

    items = Bundle("items")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.store, self.move_clock, self.cleanup = type(self).open_store()
        self.model: dict[str, Model] = {}
        self.max_token = 0
        self.final: dict[str, WorkItem] = {}
        self.lo = self.hi = 0.0
        self.priority: dict[str, int] = {}

    def teardown(self) -> None:
        self.cleanup()

    # --- time bracketing -----------------------------------------------------------------------

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` with [lo, hi] bracketing the store-clock instant it used; return result or error."""
        self.lo = ts(self.store.now()) or 0.0
        try:
            result: Any = fn()
        except DispatchError as exc:
            result = exc
        self.hi = ts(self.store.now()) or 0.0
        return result

    def live(self, m: Model) -> set[bool]:
        """Whether ``m``'s lease was live at the call instant: {True}, {False} or both."""
        assert m.expires is not None
        return {m.expires > t for t in (self.lo, self.hi)}

    def due(self, m: Model) -> set[bool]:
        return {m.not_before is None or m.not_before <= t for t in (self.lo, self.hi)}

    def claimable(self, m: Model) -> set[bool]:
        if m.state is WorkState.READY:
            return self.due(m)
        if m.state in LEASED_STATES:
            return {not alive for alive in self.live(m)}
        return {False}

    # --- expectations ----------------------------------------------------------------------------

    def expect_fenced(self, lease: Lease) -> Expected:
        m = self.model.get(lease.work_item_id)
        if m is None:
            return {NotFound}
        if m.tenant != lease.tenant:
            return {TenantMismatch}
        if m.state is WorkState.CANCELLED:
            return {Cancelled}
        if (m.epoch, m.token, m.owner) != (lease.lease_epoch, lease.fencing_token, lease.owner):
            return {Fenced}
        if m.state.terminal:
            return {InvalidTransition}
        if m.state not in LEASED_STATES:
            return {Fenced}
        return {OK if alive else LeaseExpired for alive in self.live(m)}

    def is_repeat(self, lease: Lease, outcome: Outcome, retryable: bool) -> bool:
        m = self.model.get(lease.work_item_id)
        if m is None or m.tenant != lease.tenant or m.outcome is not outcome:
            return False
        if m.commit_token != lease.fencing_token or m.token != lease.fencing_token:
            return False
        if m.epoch != lease.lease_epoch or (m.owner is not None and m.owner != lease.owner):
            return False
        if outcome is Outcome.FAILED and retryable:
            return m.state in (WorkState.READY, WorkState.DEAD_LETTER)
        return m.state.value == outcome.value

    def check(self, result: Any, expected: Expected, what: str) -> Any:
        got = type(result) if isinstance(result, DispatchError) else OK
        assert got in expected, f"{what}: got {result!r}, expected one of {expected}"
        return got

    # --- rules -------------------------------------------------------------------------------------

    @initialize(target=items, tenant=st.sampled_from(TENANTS), with_deadline=st.booleans())
    def first_item(self, tenant: str, with_deadline: bool) -> str:
        return self.submit(tenant, with_deadline, 0)

    @initialize(target=leases, worker=st.sampled_from(WORKERS))
    def first_lease(self, worker: str) -> Any:
        return self.claim_next(worker, None)

    @rule(
        target=items, tenant=st.sampled_from(TENANTS), with_deadline=st.booleans(), priority=st.integers(0, 1)
    )
    def submit(self, tenant: str, with_deadline: bool, priority: int) -> str:
        deadline = self.store.now().timestamp() + DEADLINE_S if with_deadline else None
        request = SubmitRequest(
            tenant=tenant,
            kind="turn",
            payload=b"{}",
            priority=priority,
            deadline=None if deadline is None else datetime.fromtimestamp(deadline, UTC),
        )
        result = self.store.submit(request)
        assert result.created and result.item.state is WorkState.READY
        self.model[result.item.id] = Model(result.item.id, tenant, len(self.model), ts(result.item.deadline))
        self.priority[result.item.id] = priority
        return result.item.id

    def _take(self, lease: Lease) -> Lease:
        m = self.model[lease.work_item_id]
        assert lease.fencing_token > self.max_token, "fencing tokens must strictly increase"
        assert lease.lease_epoch == m.epoch + 1, "each claim issues epoch + 1"
        assert lease.attempt == m.attempt + 1 <= MAX_ATTEMPTS
        self.max_token = lease.fencing_token
        m.state, m.epoch, m.token, m.owner = (
            WorkState.LEASED,
            lease.lease_epoch,
            lease.fencing_token,
            lease.owner,
        )
        m.attempt, m.expires, m.not_before, m.commit_token = lease.attempt, ts(lease.expires_at), None, None
        return lease

    def _dead_lettered_by_claim(self, m: Model) -> bool:
        """The claim found ``m`` claimable with its attempts spent: it must now be dead-lettered."""
        got = self.store.get(m.id)
        if got.state is WorkState.DEAD_LETTER and m.state is not WorkState.DEAD_LETTER:
            assert True in self.claimable(m) and m.attempt >= MAX_ATTEMPTS
            m.state, m.outcome = WorkState.DEAD_LETTER, Outcome.FAILED
            return True
        return False

    @rule(target=leases, worker=st.sampled_from(WORKERS), tenant=st.sampled_from((None, *TENANTS)))
    def claim_next(self, worker: str, tenant: str | None) -> Any:
        order = sorted(
            (m for m in self.model.values() if tenant is None or m.tenant == tenant),
            key=lambda m: (-self.priority[m.id], m.seq),
        )
        before = {m.id: dataclasses.replace(m) for m in order}
        result = self.call(lambda: self.store.claim(worker, tenant=tenant))
        assert not isinstance(result, DispatchError), result
        claimed = None if result is None else result.work_item_id
        for m in order:
            old = before[m.id]
            if m.id == claimed:
                assert True in self.claimable(old), f"claimed {m.id}, which was not claimable"
                break
            if self._dead_lettered_by_claim(m):
                continue
            # Passed over: it must not have been surely claimable (with attempts left).
            assert self.claimable(old) != {True}, f"skipped {m.id}, which was claimable"
        if result is None:
            return multiple()
        return self._take(result)

    @rule(target=leases, item=items, worker=st.sampled_from(WORKERS), wrong_tenant=st.booleans())
    def claim_named(self, item: str, worker: str, wrong_tenant: bool) -> Any:
        m = self.model[item]
        tenant = next(t for t in TENANTS if t != m.tenant) if wrong_tenant else m.tenant
        before = dataclasses.replace(m)
        result = self.call(lambda: self.store.claim(worker, work_item_id=item, tenant=tenant))
        if wrong_tenant:
            expected: Expected = {TenantMismatch}
        elif m.state.terminal:
            expected = {InvalidTransition}
        elif m.state in LEASED_STATES:
            expected = {LeaseHeld if alive else OK for alive in self.live(m)}
        else:
            expected = {OK}
        self.check(result, expected, "claim by name")
        if isinstance(result, Lease):
            return self._take(result)
        # None: not due yet (backing off), or dead-lettered because its attempts were spent.
        if result is None and not self._dead_lettered_by_claim(m):
            assert False in self.claimable(before), "a claimable item was not claimed"
        return multiple()

    def startable(self, m: Model, tenant: str) -> set[bool]:
        """Whether start_many may take ``m`` at the call instant: {True}, {False} or both."""

        def at(t: float) -> bool:
            if tenant != m.tenant or m.attempt >= MAX_ATTEMPTS:
                return False
            if m.deadline is not None and m.deadline <= t:
                return False
            if m.state is WorkState.READY:
                return m.not_before is None or m.not_before <= t
            return m.state in LEASED_STATES and m.expires is not None and m.expires <= t

        return {at(self.lo), at(self.hi)}

    @rule(
        target=leases,
        picks=st.lists(st.tuples(items, st.booleans()), min_size=1, max_size=4),
        worker=st.sampled_from(WORKERS),
    )
    def start_many(self, picks: list[tuple[str, bool]], worker: str) -> Any:
        claims = [
            (
                item,
                next(t for t in TENANTS if t != self.model[item].tenant)
                if wrong
                else self.model[item].tenant,
            )
            for item, wrong in picks
        ]
        result = self.call(lambda: self.store.start_many(worker, claims))
        assert not isinstance(result, DispatchError), result
        first = dict(reversed(claims))  # the first pair per id counts
        for item, tenant in first.items():
            possible = self.startable(self.model[item], tenant)
            if item in result:
                assert True in possible, f"start_many took {item}, which was not simply claimable"
            else:
                assert False in possible, f"start_many left out {item}, which was simply claimable"
        assert set(result) <= set(first)
        leases = []
        for turn in sorted(result.values(), key=lambda turn: turn.lease.fencing_token):
            assert turn.payload == b"{}" and turn.lease.owner == worker
            leases.append(self._take(turn.lease))
            self.model[turn.lease.work_item_id].state = WorkState.RUNNING
        return multiple(*leases)

    @rule(
        picks=st.lists(
            st.tuples(leases, st.sampled_from((Outcome.SUCCEEDED, Outcome.FAILED, Outcome.CANCELLED))),
            min_size=1,
            max_size=4,
        )
    )
    def commit_many(self, picks: list[tuple[Lease, Outcome]]) -> None:
        result = self.call(
            lambda: self.store.commit_many([(lease, outcome, "x") for lease, outcome in picks])
        )
        assert not isinstance(result, DispatchError), result
        first: dict[tuple[str, str, str, int, int], tuple[Lease, Outcome]] = {}
        for lease, outcome in picks:
            key = (lease.work_item_id, lease.tenant, lease.owner, lease.lease_epoch, lease.fencing_token)
            first.setdefault(key, (lease, outcome))
        for lease, outcome in first.values():
            expected = self.expect_fenced(lease)  # nothing in this machine has dependents
            got = result.get(lease.work_item_id)
            if got is None or got.fencing_token != lease.fencing_token:  # tokens are unique per claim
                assert expected != {OK}, f"commit_many left out {lease.work_item_id}, whose lease is current"
                continue
            assert OK in expected, f"commit_many committed {lease.work_item_id} under {expected}"
            assert got.state.value == outcome.value and got.outcome is outcome
            m = self.model[lease.work_item_id]
            m.state, m.outcome, m.commit_token = got.state, outcome, lease.fencing_token
        assert set(result) <= {lease.work_item_id for lease, _ in first.values()}

    @rule(
        lease=leases,
        op=st.sampled_from(OPS),
        forge=st.sampled_from((None, "tenant", "owner", "epoch", "token")),
    )
    def fenced(self, lease: Lease, op: str, forge: str | None) -> None:
        if forge == "tenant":
            lease = dataclasses.replace(lease, tenant=next(t for t in TENANTS if t != lease.tenant))
        elif forge == "owner":
            lease = dataclasses.replace(lease, owner="intruder")
        elif forge == "epoch":
            lease = dataclasses.replace(lease, lease_epoch=lease.lease_epoch + 1)
        elif forge == "token":
            lease = dataclasses.replace(lease, fencing_token=lease.fencing_token + 10_000)
        m = self.model[lease.work_item_id]
        outcome = {
            "commit_succeeded": Outcome.SUCCEEDED,
            "commit_failed": Outcome.FAILED,
            "commit_cancelled": Outcome.CANCELLED,
            "commit_retryable": Outcome.FAILED,
            "retry": Outcome.FAILED,
        }.get(op)
        retryable = op in ("commit_retryable", "retry")
        repeat = outcome is not None and self.is_repeat(lease, outcome, retryable)
        s = self.store
        calls: dict[str, Callable[[], Any]] = {
            "require_current": lambda: s.require_current(lease),
            "renew": lambda: s.renew(lease),
            "mark_running": lambda: s.mark_running(lease),
            "commit_succeeded": lambda: s.commit(lease, Outcome.SUCCEEDED),
            "commit_failed": lambda: s.commit(lease, Outcome.FAILED, error="no"),
            "commit_cancelled": lambda: s.commit(lease, Outcome.CANCELLED),
            "commit_retryable": lambda: s.commit(lease, Outcome.FAILED, retryable=True, error="again"),
            "retry": lambda: s.retry(lease, error="again"),
            "defer": lambda: s.defer(lease),
        }
        result = self.call(calls[op])
        # After the call (the model is still as before it): [lo, hi] now brackets this call.
        expected = {OK} if repeat else self.expect_fenced(lease)
        if self.check(result, expected, f"{op} (forged {forge})") is not OK:
            return
        assert forge is None or repeat, f"a forged lease ({forge}) was accepted by {op}"
        if repeat:
            if op.startswith("commit"):
                assert result.repeated, f"{op} repeated but not reported as repeated"
            return
        if op.startswith("commit"):
            assert not result.repeated, f"{op} applied but reported as repeated"
        if op.startswith("commit") and op != "commit_retryable":
            assert outcome is not None
            m.state, m.outcome, m.commit_token = WorkState(outcome.value), outcome, lease.fencing_token
        elif op in ("commit_retryable", "retry"):
            item = result.item if op == "commit_retryable" else result
            m.outcome, m.commit_token = Outcome.FAILED, lease.fencing_token
            if m.attempt >= MAX_ATTEMPTS:
                assert item.state is WorkState.DEAD_LETTER
                m.state = WorkState.DEAD_LETTER
            else:
                assert item.state is WorkState.READY and item.not_before is not None
                m.state, m.owner, m.not_before = WorkState.READY, None, ts(item.not_before)
        elif op == "defer":
            m.state, m.owner, m.attempt, m.not_before, m.commit_token = (
                WorkState.READY,
                None,
                m.attempt - 1,
                None,
                None,
            )
        elif op == "mark_running":
            m.state = WorkState.RUNNING
        elif op == "renew":
            assert result.expires_at >= lease.expires_at
            m.expires = ts(result.expires_at)

    @rule(lease=leases, op=st.sampled_from(OPS))
    def fenced_honest(self, lease: Lease, op: str) -> None:
        """The common case, drawn more often: the lease as issued (current or stale)."""
        self.fenced(lease, op, None)

    @rule(item=items, wrong_tenant=st.booleans())
    def cancel(self, item: str, wrong_tenant: bool) -> None:
        m = self.model[item]
        tenant = next(t for t in TENANTS if t != m.tenant) if wrong_tenant else m.tenant
        result = self.call(lambda: self.store.cancel(item, tenant=tenant, reason="user"))
        expected = {NotFound} if wrong_tenant else {InvalidTransition} if m.state.terminal else {OK}
        if self.check(result, expected, "cancel") is OK:
            m.state, m.outcome = WorkState.CANCELLED, Outcome.CANCELLED

    @rule()
    def expire(self) -> None:
        result = self.call(self.store.expire)
        assert not isinstance(result, DispatchError), result
        expired = {item.id for item in result}
        for m in self.model.values():
            if m.state.terminal or m.deadline is None:
                assert m.id not in expired
                continue
            overdue = {m.deadline <= t for t in (self.lo, self.hi)}
            if m.id in expired:
                assert True in overdue
                m.state, m.outcome = WorkState.CANCELLED, Outcome.CANCELLED
            else:
                assert False in overdue, f"{m.id} is past its deadline but was not expired"

    @rule(seconds=st.sampled_from((25.0, 61.0)))
    def advance(self, seconds: float) -> None:
        self.move_clock(seconds)

    # --- invariants --------------------------------------------------------------------------------

    @invariant()
    def store_agrees_with_the_model(self) -> None:
        stored = {
            item.id: item for tenant in TENANTS for item in self.store.list_items(tenant=tenant, limit=1000)
        }
        assert set(stored) == set(self.model)
        if isinstance(self.store, CountsUnfinished):  # the admission bound's O(1) count (schema v2)
            assert self.store.unfinished() == sum(not m.state.terminal for m in self.model.values())
        for item_id, m in self.model.items():
            got = stored[item_id]
            assert got.state is m.state, f"{item_id}: store {got.state}, model {m.state}"
            assert (got.lease_epoch, got.fencing_token, got.attempt) == (m.epoch, m.token, m.attempt)
            assert got.attempt <= got.max_attempts == MAX_ATTEMPTS
            assert got.fencing_token <= self.max_token
            if got.terminal:
                # Terminal states are final: once recorded, the item never changes again.
                assert self.final.setdefault(item_id, got) == got, f"terminal item {item_id} changed"


def _run(
    open_store: Callable[[], tuple[WorkItemStore, Callable[[float], None], Callable[[], None]]],
    examples: int,
    steps: int,
) -> None:
    machine = type("BoundMachine", (StoreMachine,), {"open_store": staticmethod(open_store)})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )


def test_memory_store_against_the_model() -> None:
    def open_store() -> tuple[WorkItemStore, Callable[[float], None], Callable[[], None]]:
        clock = FakeClock()
        store = MemoryStore(store_settings(max_attempts=MAX_ATTEMPTS, claim_ttl_s=TTL), clock=clock)

        def move(seconds: float) -> None:
            clock.t += seconds

        return store, move, store.close

    _run(open_store, examples=200, steps=40)


def _offset_mover(store: SqliteStore | PostgresStore) -> Callable[[float], None]:
    offset = [0.0]

    def move(seconds: float) -> None:
        offset[0] += seconds
        store.set_clock_offset_for_tests(offset[0])

    return move


def test_sqlite_store_against_the_model(tmp_path: Path) -> None:
    counter = iter(range(1_000_000))

    def open_store() -> tuple[WorkItemStore, Callable[[float], None], Callable[[], None]]:
        store = SqliteStore(
            tmp_path / f"s{next(counter)}.sqlite3", store_settings(max_attempts=MAX_ATTEMPTS, claim_ttl_s=TTL)
        )
        store.migrate()
        return store, _offset_mover(store), store.close

    _run(open_store, examples=60, steps=40)


@pytest.fixture
def postgres_store(postgres_dsn: str) -> Iterator[PostgresStore]:
    store = PostgresStore(
        postgres_dsn, store_settings(max_attempts=MAX_ATTEMPTS, claim_ttl_s=TTL), max_size=2
    )
    store.migrate()
    yield store
    store.close()


@pytest.mark.postgres
def test_postgres_store_against_the_model(postgres_store: PostgresStore, postgres_dsn: str) -> None:
    def open_store() -> tuple[WorkItemStore, Callable[[float], None], Callable[[], None]]:
        # One database for the whole test: each example starts from empty tables and clock.
        reset_postgres(postgres_dsn)
        postgres_store.set_clock_offset_for_tests(0)
        return postgres_store, _offset_mover(postgres_store), lambda: None

    _run(open_store, examples=50, steps=40)
