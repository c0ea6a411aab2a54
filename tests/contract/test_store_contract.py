"""The WorkItemStore contract: one suite, run against memory, SQLite and a real PostgreSQL.

Every behaviour the Protocol docstrings promise is pinned here, including the exact typed error
a stale or foreign caller gets. Time is moved with the harness (a fake clock for memory, the
stores' explicit clock-offset test hook for the databases), never by sleeping.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent_dispatch.errors import (
    Cancelled,
    Fenced,
    IdempotencyConflict,
    InvalidRequest,
    InvalidTransition,
    LeaseExpired,
    LeaseHeld,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    SchemaOutdated,
    TenantMismatch,
)
from agent_dispatch.jobs import graph_jobs
from agent_dispatch.models import Lease, Outcome, SubmitRequest, WorkItem, WorkState, deterministic_id
from agent_dispatch.store import MAX_ERROR_CHARS, SCHEMA_VERSION, WorkItemStore
from agent_dispatch.stores import open_store
from agent_dispatch.stores.postgres import PostgresStore
from agent_dispatch.stores.sqlite import SqliteStore
from tests.contract._store_harness import (  # noqa: F401 (store_postgres_dsn is a fixture)
    BACKENDS,
    DB_BACKENDS,
    Harness,
    open_harness,
    store_postgres_dsn,
    store_settings,
)

TTL = 60.0  # the harness settings' claim TTL


@pytest.fixture(params=BACKENDS)
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    with open_harness(request.param, request, tmp_path) as harness:
        yield harness


def submit(store: WorkItemStore, tenant: str = "t1", payload: bytes = b"{}", **kw: object) -> WorkItem:
    result = store.submit(
        SubmitRequest(tenant=tenant, kind=str(kw.pop("kind", "turn")), payload=payload, **kw)
    )  # type: ignore[arg-type]
    assert result.created
    return result.item


def lease_of(store: WorkItemStore, item: WorkItem, owner: str = "w1") -> Lease:
    lease = store.claim(owner, work_item_id=item.id)
    assert lease is not None
    return lease


def events(store: WorkItemStore, item_id: str) -> list[str]:
    return [record.event for record in store.outcomes(item_id)]


def close_to(a: datetime, b: datetime, seconds: float = 5.0) -> bool:
    return abs((a - b).total_seconds()) <= seconds


# --- submit ------------------------------------------------------------------------------------------------


def test_submit_stores_a_ready_item_with_its_payload(h: Harness) -> None:
    s = h.store
    before = s.now()
    item = submit(s, payload=b'{"q": 1}', session_id="sess-1", priority=5, queue="q1")
    assert item.state is WorkState.READY
    assert (item.tenant, item.kind, item.queue, item.session_id, item.priority) == (
        "t1",
        "turn",
        "q1",
        "sess-1",
        5,
    )
    assert (item.attempt, item.lease_epoch, item.fencing_token, item.max_attempts) == (0, 0, 0, 3)
    assert item.payload_size == 8
    assert close_to(item.created_at, before)
    assert s.get(item.id) == item
    assert s.get(item.id, tenant="t1") == item
    assert s.get_payload(item.id, tenant="t1") == b'{"q": 1}'
    assert events(s, item.id) == ["submit"]


def test_session_defaults_to_the_item_id_and_max_attempts_can_be_set(h: Harness) -> None:
    item = submit(h.store, max_attempts=7)
    assert item.session_id == item.id
    assert item.max_attempts == 7


@pytest.mark.parametrize("tenant", ["", "   "])
def test_submit_requires_a_tenant_and_stores_nothing(h: Harness, tenant: str) -> None:
    with pytest.raises(InvalidRequest, match="tenant"):
        h.store.submit(SubmitRequest(tenant=tenant, kind="turn", payload=b"x", idempotency_key="k"))
    assert h.store.list_items(tenant=tenant) == []


def test_payload_over_the_bound_is_refused_and_nothing_is_stored(h: Harness) -> None:
    with pytest.raises(PayloadTooLarge):
        h.store.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"x" * 1025, idempotency_key="big"))
    assert h.store.list_items(tenant="t1") == []
    assert submit(h.store, payload=b"x" * 1024).payload_size == 1024


def test_submit_is_idempotent_on_tenant_and_key(h: Harness) -> None:
    s = h.store
    request = SubmitRequest(tenant="t1", kind="turn", payload=b"p", idempotency_key="key-1")
    first = s.submit(request)
    again = s.submit(request)
    assert first.created and not again.created
    assert again.item == first.item
    assert first.item.id == deterministic_id("t1", "key-1")
    assert first.item.idempotency_key == "key-1"
    with pytest.raises(IdempotencyConflict):
        s.submit(dataclasses.replace(request, payload=b"other"))
    with pytest.raises(IdempotencyConflict):
        s.submit(dataclasses.replace(request, kind="other-kind"))
    # The key is scoped by tenant: another tenant's identical key is another item.
    other = s.submit(dataclasses.replace(request, tenant="t2"))
    assert other.created and other.item.id != first.item.id
    assert len(s.list_items(tenant="t1")) == 1
    assert events(s, first.item.id) == ["submit"]


def test_submit_is_idempotent_on_an_explicit_id(h: Harness) -> None:
    s = h.store
    request = SubmitRequest(tenant="t1", kind="turn", payload=b"p", work_item_id="job-42")
    assert s.submit(request).created
    again = s.submit(request)
    assert not again.created and again.item.id == "job-42"
    with pytest.raises(IdempotencyConflict):
        s.submit(dataclasses.replace(request, payload=b"changed"))
    with pytest.raises(IdempotencyConflict):
        s.submit(dataclasses.replace(request, tenant="t2"))
    # An explicit id and a key naming another item disagree.
    s.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"p", idempotency_key="k9"))
    with pytest.raises(IdempotencyConflict):
        s.submit(
            SubmitRequest(tenant="t1", kind="turn", payload=b"p", idempotency_key="k9", work_item_id="job-43")
        )


def test_invalid_requests_are_refused_before_anything_is_written(h: Harness) -> None:
    s = h.store
    with pytest.raises(InvalidRequest):
        s.submit(SubmitRequest(tenant="t1", kind="", payload=b""))
    with pytest.raises(InvalidRequest):
        s.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"", work_item_id="a", depends_on=("a",)))
    with pytest.raises(InvalidRequest):
        s.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"", max_attempts=0))
    with pytest.raises(InvalidRequest):
        s.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"", deadline=datetime(2030, 1, 1)))
    assert s.list_items(tenant="t1") == []


# --- dependencies ----------------------------------------------------------------------------------------


def test_dependents_wait_and_become_ready_in_the_commit_of_their_last_dependency(h: Harness) -> None:
    s = h.store
    a, b = submit(s), submit(s)
    child = submit(s, depends_on=(a.id, b.id, a.id))
    assert child.state is WorkState.SUBMITTED
    assert child.depends_on == (a.id, b.id)
    assert s.claim("w1", work_item_id=a.id) is not None
    with pytest.raises(InvalidTransition, match="dependencies"):
        s.claim("w1", work_item_id=child.id)
    s.commit(lease_of_current(s, a.id), Outcome.SUCCEEDED)
    assert s.get(child.id).state is WorkState.SUBMITTED
    lease_b = lease_of(s, b)
    result = s.commit(lease_b, Outcome.SUCCEEDED)
    assert result.item.state is WorkState.SUCCEEDED
    assert s.get(child.id).state is WorkState.READY
    assert events(s, child.id) == ["submit", "ready"]
    assert b.id in (s.outcomes(child.id)[-1].detail or "")
    assert s.claim("w2") is not None  # the released dependent is claimable


def lease_of_current(s: WorkItemStore, item_id: str) -> Lease:
    item = s.get(item_id)
    assert item.lease_owner is not None and item.lease_expires_at is not None
    return Lease(
        item.id,
        item.tenant,
        item.lease_owner,
        item.lease_epoch,
        item.fencing_token,
        item.lease_expires_at,
        item.attempt,
    )


def test_a_dependency_that_already_succeeded_does_not_hold_a_dependent(h: Harness) -> None:
    s = h.store
    a = submit(s)
    s.commit(lease_of(s, a), Outcome.SUCCEEDED)
    assert submit(s, depends_on=(a.id,)).state is WorkState.READY


def test_dependencies_must_exist_in_the_same_tenant(h: Harness) -> None:
    s = h.store
    foreign = submit(s, tenant="t2")
    with pytest.raises(NotFound):
        s.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"", depends_on=(foreign.id,)))
    with pytest.raises(NotFound):
        s.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"", depends_on=("no-such-item",)))
    assert s.list_items(tenant="t1") == []


@pytest.mark.parametrize(
    ("how", "ended"),
    [
        ("failed", "failed"),
        ("cancelled", "cancelled"),
        ("cancel", "cancelled"),
        ("retry-spent", "dead_letter"),
        ("dead_letter", "dead_letter"),
    ],
)
def test_a_dependency_that_cannot_succeed_cancels_its_dependents_transitively(
    h: Harness, how: str, ended: str
) -> None:
    s = h.store
    root = submit(s, max_attempts=1)
    child = submit(s, depends_on=(root.id,))
    grandchild = submit(s, depends_on=(child.id,))
    bystander = submit(s)
    if how == "cancel":
        s.cancel(root.id, tenant="t1", reason="user asked")
    elif how == "dead_letter":
        s.dead_letter(root.id, reason="poison")
    elif how == "retry-spent":
        s.retry(lease_of(s, root), error="boom")
    else:
        s.commit(lease_of(s, root), Outcome(how), error="boom")
    assert s.get(root.id).state.value == ended
    for dependent in (child, grandchild):
        got = s.get(dependent.id)
        assert got.state is WorkState.CANCELLED
        assert got.outcome is Outcome.CANCELLED
        assert events(s, dependent.id)[-1] == "cancel"
    assert s.get(child.id).error == f"dependency {root.id} ended {ended}"
    assert s.get(grandchild.id).error == f"dependency {child.id} ended cancelled"
    assert s.get(bystander.id).state is WorkState.READY


def test_submitting_after_a_dependency_failed_cancels_at_once(h: Harness) -> None:
    s = h.store
    root = submit(s)
    s.commit(lease_of(s, root), Outcome.FAILED)
    item = s.submit(SubmitRequest(tenant="t1", kind="turn", payload=b"", depends_on=(root.id,))).item
    assert item.state is WorkState.CANCELLED
    assert item.error == f"dependency {root.id} ended failed"
    assert events(s, item.id) == ["submit", "cancel"]


# --- claim -------------------------------------------------------------------------------------------------


def test_claim_issues_epoch_attempt_token_owner_and_expiry_from_the_store_clock(h: Harness) -> None:
    s = h.store
    item = submit(s)
    before = s.now()
    lease = s.claim("worker-a", ttl_s=30)
    assert lease is not None
    assert (lease.work_item_id, lease.tenant, lease.owner) == (item.id, "t1", "worker-a")
    assert (lease.lease_epoch, lease.attempt) == (1, 1)
    assert lease.fencing_token >= 1
    assert close_to(lease.expires_at, before + timedelta(seconds=30), 2)
    got = s.get(item.id)
    assert got.state is WorkState.LEASED
    assert (got.lease_owner, got.lease_epoch, got.fencing_token, got.attempt) == (
        "worker-a",
        1,
        lease.fencing_token,
        1,
    )
    assert got.lease_expires_at == lease.expires_at
    default = s.claim("worker-b", work_item_id=submit(s).id)
    assert default is not None
    assert close_to(default.expires_at, s.now() + timedelta(seconds=TTL), 2)


def test_fencing_tokens_increase_strictly_across_the_whole_store(h: Harness) -> None:
    s = h.store
    items = [submit(s, tenant=f"t{i % 2}") for i in range(6)]
    tokens = []
    for item in items:
        lease = lease_of(s, item)
        tokens.append(lease.fencing_token)
        s.defer(lease)
        tokens.append(lease_of(s, item).fencing_token)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_claim_next_follows_priority_then_age_and_filters(h: Harness) -> None:
    s = h.store
    low = submit(s, priority=0)
    high = submit(s, priority=9)
    low2 = submit(s, priority=0)
    other_queue = submit(s, priority=99, queue="other")
    other_tenant = submit(s, tenant="t2", priority=50)
    first = s.claim("w", queue="default", tenant="t1")
    second = s.claim("w", queue="default", tenant="t1")
    third = s.claim("w", queue="default", tenant="t1")
    assert [x.work_item_id for x in (first, second, third) if x] == [high.id, low.id, low2.id]
    assert s.claim("w", queue="default", tenant="t1") is None
    got = s.claim("w", tenant="t2")
    assert got is not None and got.work_item_id == other_tenant.id
    got = s.claim("w")
    assert got is not None and got.work_item_id == other_queue.id
    assert s.claim("w") is None


def test_claim_of_a_named_item(h: Harness) -> None:
    s = h.store
    item = submit(s)
    with pytest.raises(NotFound):
        s.claim("w", work_item_id="missing")
    with pytest.raises(TenantMismatch):
        s.claim("w", work_item_id=item.id, tenant="t2")
    lease = s.claim("w", work_item_id=item.id, tenant="t1")
    assert lease is not None
    with pytest.raises(LeaseHeld):
        s.claim("w2", work_item_id=item.id)
    assert s.claim("w2") is None  # a live lease is not claimable as "next" either
    s.commit(lease, Outcome.SUCCEEDED)
    with pytest.raises(InvalidTransition):
        s.claim("w2", work_item_id=item.id)


def test_an_expired_lease_is_reclaimed_and_the_old_holder_is_fenced(h: Harness) -> None:
    s = h.store
    item = submit(s)
    old = lease_of(s, item, "w1")
    h.advance(TTL + 1)
    new = s.claim("w2")
    assert new is not None and new.work_item_id == item.id
    assert (new.lease_epoch, new.attempt) == (2, 2)
    assert new.fencing_token > old.fencing_token
    assert s.outcomes(item.id)[-1].detail == "reclaimed an expired lease held by w1"
    for call in fenced_calls(s):
        with pytest.raises(Fenced):
            call(old)
    s.require_current(new)
    # ... and the named form reclaims too.
    h.advance(TTL + 1)
    third = s.claim("w3", work_item_id=item.id)
    assert third is not None and third.lease_epoch == 3


def fenced_calls(s: WorkItemStore) -> list:  # type: ignore[type-arg]
    return [
        s.require_current,
        s.renew,
        s.mark_running,
        lambda lease: s.commit(lease, Outcome.SUCCEEDED),
        lambda lease: s.commit(lease, Outcome.FAILED, retryable=True),
        lambda lease: s.retry(lease, error="x"),
        s.defer,
    ]


def test_claiming_past_max_attempts_dead_letters_and_moves_on(h: Harness) -> None:
    s = h.store
    doomed = submit(s, max_attempts=2, priority=1)
    dependent = submit(s, depends_on=(doomed.id,))
    fine = submit(s)
    lease_of(s, doomed)
    h.advance(TTL + 1)
    assert s.claim("w", work_item_id=doomed.id) is not None  # attempt 2 of 2
    h.advance(TTL + 1)
    nxt = s.claim("w")  # a third attempt would exceed 2: dead-letter it, take the next one
    assert nxt is not None and nxt.work_item_id == fine.id
    got = s.get(doomed.id)
    assert got.state is WorkState.DEAD_LETTER
    assert got.attempt == 2
    assert "attempts exhausted" in (got.error or "")
    assert events(s, doomed.id)[-1] == "dead_letter"
    assert s.get(dependent.id).state is WorkState.CANCELLED

    other = submit(s, max_attempts=1)
    lease_of(s, other)
    h.advance(TTL + 1)
    assert s.claim("w", work_item_id=other.id) is None
    assert s.get(other.id).state is WorkState.DEAD_LETTER


# --- fenced calls ------------------------------------------------------------------------------------------


def test_every_fenced_call_checks_tenant_owner_epoch_token_and_expiry(h: Harness) -> None:
    s = h.store
    item = submit(s)
    lease = lease_of(s, item)
    forged = {
        TenantMismatch: [dataclasses.replace(lease, tenant="t2")],
        Fenced: [
            dataclasses.replace(lease, owner="intruder"),
            dataclasses.replace(lease, lease_epoch=lease.lease_epoch + 1),
            dataclasses.replace(lease, lease_epoch=lease.lease_epoch - 1),
            dataclasses.replace(lease, fencing_token=lease.fencing_token + 1000),
        ],
        NotFound: [dataclasses.replace(lease, work_item_id="missing")],
    }
    for error, leases in forged.items():
        for bad in leases:
            for call in fenced_calls(s):
                with pytest.raises(error):
                    call(bad)
    assert s.get(item.id).state is WorkState.LEASED  # nothing was changed by any of them
    assert events(s, item.id) == ["submit", "claim"]
    h.advance(TTL + 1)
    for call in fenced_calls(s):
        with pytest.raises(LeaseExpired):
            call(lease)
    assert issubclass(LeaseExpired, LeaseLost) and issubclass(Fenced, LeaseLost)


def test_mark_running_renew_and_require_current(h: Harness) -> None:
    s = h.store
    item = submit(s)
    lease = lease_of(s, item)
    running = s.mark_running(lease)
    assert running == lease
    assert s.get(item.id).state is WorkState.RUNNING
    assert s.mark_running(lease) == lease  # idempotent
    h.advance(TTL - 10)
    s.require_current(lease)
    renewed = s.renew(lease, ttl_s=100)
    assert renewed.expires_at > lease.expires_at
    assert close_to(renewed.expires_at, s.now() + timedelta(seconds=100), 2)
    assert (renewed.lease_epoch, renewed.fencing_token) == (lease.lease_epoch, lease.fencing_token)
    h.advance(90)  # past the original expiry, within the renewed one
    s.require_current(renewed)
    s.require_current(lease)  # the lease identity is what is checked, not the caller's copy of expiry
    assert events(s, item.id) == ["submit", "claim", "running"]  # renewals are not recorded
    h.advance(11)
    with pytest.raises(LeaseExpired):
        s.renew(renewed)


def test_commit_success_is_terminal_and_a_repeat_is_a_reported_no_op(h: Harness) -> None:
    s = h.store
    item = submit(s)
    lease = lease_of(s, item)
    s.mark_running(lease)
    result = s.commit(lease, Outcome.SUCCEEDED)
    assert not result.repeated
    assert result.item.state is WorkState.SUCCEEDED and result.item.outcome is Outcome.SUCCEEDED
    recorded = s.outcomes(item.id)
    again = s.commit(lease, Outcome.SUCCEEDED)
    assert again.repeated and again.item == s.get(item.id)
    assert s.outcomes(item.id) == recorded
    h.advance(TTL * 10)  # still recognised as the same commit long after the lease would expire
    assert s.commit(lease, Outcome.SUCCEEDED).repeated
    with pytest.raises(InvalidTransition):
        s.commit(lease, Outcome.FAILED)
    with pytest.raises(InvalidTransition):
        s.cancel(item.id, tenant="t1", reason="too late")
    assert s.get(item.id).state is WorkState.SUCCEEDED


@pytest.mark.parametrize(
    ("outcome", "state"), [(Outcome.FAILED, WorkState.FAILED), (Outcome.CANCELLED, WorkState.CANCELLED)]
)
def test_commit_failed_or_cancelled(h: Harness, outcome: Outcome, state: WorkState) -> None:
    s = h.store
    item = submit(s)
    lease = lease_of(s, item)
    result = s.commit(lease, outcome, error="x" * (MAX_ERROR_CHARS + 500))
    assert result.item.state is state and result.item.outcome is outcome
    assert len(result.item.error or "") == MAX_ERROR_CHARS  # error detail is bounded
    assert s.commit(lease, outcome).repeated
    record = s.outcomes(item.id)[-1]
    assert (record.event, record.outcome, record.owner) == ("commit", outcome.value, "w1")
    assert (record.lease_epoch, record.fencing_token) == (lease.lease_epoch, lease.fencing_token)
    assert len(record.detail or "") == MAX_ERROR_CHARS


def test_retryable_failure_backs_off_then_dead_letters_when_attempts_are_spent(h: Harness) -> None:
    s = h.store
    item = submit(s)  # max_attempts 3
    for attempt in (1, 2):
        lease = lease_of(s, item)
        assert lease.attempt == attempt
        now = s.now()
        result = s.commit(lease, Outcome.FAILED, retryable=True, error=f"try {attempt}")
        got = result.item
        assert not result.repeated
        assert (
            got.state is WorkState.READY and got.outcome is Outcome.FAILED and got.error == f"try {attempt}"
        )
        assert got.lease_owner is None
        assert got.not_before is not None
        ceiling = 2 ** (attempt - 1)
        delay = (got.not_before - now).total_seconds()
        assert ceiling / 2 - 1 <= delay <= ceiling + 1
        assert s.commit(lease, Outcome.FAILED, retryable=True).repeated
        with pytest.raises(Fenced):
            s.renew(lease)
        assert s.claim("w") is None or (attempt == 1 and delay <= 0)  # backing off: not claimable yet
        h.advance(ceiling + 1)
    lease = lease_of(s, item)
    assert lease.attempt == 3
    dead = s.retry(lease, error="last")
    assert dead.state is WorkState.DEAD_LETTER and dead.error == "last"
    assert s.retry(lease).state is WorkState.DEAD_LETTER  # a repeat is a no-op
    assert events(s, item.id) == ["submit", "claim", "retry", "claim", "retry", "claim", "dead_letter"]


def test_a_backing_off_item_is_not_claimable_by_name_until_due(h: Harness) -> None:
    s = h.store
    item = submit(s)
    got = s.retry(lease_of(s, item), error="e")
    assert got.not_before is not None and got.not_before > s.now()
    assert s.claim("w", work_item_id=item.id) is None
    h.advance(2)
    assert s.claim("w", work_item_id=item.id) is not None


def test_defer_releases_without_spending_an_attempt(h: Harness) -> None:
    s = h.store
    item = submit(s)
    lease = lease_of(s, item)
    got = s.defer(lease)
    assert got.state is WorkState.READY and got.attempt == 0 and got.not_before is None
    assert got.lease_owner is None
    with pytest.raises(Fenced):
        s.commit(lease, Outcome.SUCCEEDED)
    second = lease_of(s, item)
    assert (second.attempt, second.lease_epoch) == (1, 2)
    delayed = s.defer(second, delay_s=30)
    assert delayed.not_before is not None and close_to(delayed.not_before, s.now() + timedelta(seconds=30), 2)
    assert s.claim("w") is None
    h.advance(31)
    assert s.claim("w") is not None
    record = s.outcomes(item.id)[-2]
    assert (record.event, record.owner, record.lease_epoch) == ("defer", "w1", 2)


# --- cancel, expire, dead letter -----------------------------------------------------------------------------


def test_cancel_from_each_non_terminal_state_and_the_holder_learns(h: Harness) -> None:
    s = h.store
    waiting = submit(s, depends_on=(submit(s).id,))
    ready = submit(s)
    leased_item = submit(s)
    leased = lease_of(s, leased_item)
    running_item = submit(s)
    running = lease_of(s, running_item)
    s.mark_running(running)
    for item in (waiting, ready, leased_item, running_item):
        got = s.cancel(item.id, tenant="t1", reason="user asked")
        assert got.state is WorkState.CANCELLED and got.error == "user asked"
        assert events(s, item.id)[-1] == "cancel"
    for lease in (leased, running):
        for call in fenced_calls(s):
            with pytest.raises(Cancelled):
                call(lease)
    with pytest.raises(InvalidTransition):
        s.cancel(ready.id, tenant="t1", reason="again")
    with pytest.raises(NotFound):
        s.cancel(submit(s).id, tenant="t2", reason="not yours")
    with pytest.raises(NotFound):
        s.cancel("missing", tenant="t1", reason="x")


def test_expire_cancels_items_past_their_deadline(h: Harness) -> None:
    s = h.store
    now = s.now()
    soon = submit(s, deadline=now + timedelta(seconds=10))
    held = submit(s, deadline=now + timedelta(seconds=20))
    lease = lease_of(s, held)
    later = submit(s, deadline=now + timedelta(seconds=1000))
    never = submit(s)
    dependent = submit(s, depends_on=(soon.id,))
    assert s.expire() == []
    h.advance(30)
    expired = s.expire()
    assert sorted(i.id for i in expired) == sorted([soon.id, held.id])
    for item in expired:
        assert item.state is WorkState.CANCELLED and item.error == "deadline expired"
        assert events(s, item.id)[-1] == "expire"
    with pytest.raises(Cancelled):
        s.require_current(lease)
    assert s.get(later.id).state is WorkState.READY
    assert s.get(never.id).state is WorkState.READY
    assert s.get(dependent.id).state is WorkState.CANCELLED
    assert s.expire() == []


def test_dead_letter_is_unfenced_poison_handling(h: Harness) -> None:
    s = h.store
    item = submit(s)
    got = s.dead_letter(item.id, reason="poison envelope")
    assert got.state is WorkState.DEAD_LETTER and got.error == "poison envelope"
    with pytest.raises(InvalidTransition):
        s.dead_letter(item.id, reason="again")
    with pytest.raises(NotFound):
        s.dead_letter("missing", reason="x")


def test_terminal_states_are_final(h: Harness) -> None:
    s = h.store
    item = submit(s)
    lease = lease_of(s, item)
    s.commit(lease, Outcome.SUCCEEDED)
    for attempt in (
        lambda: s.claim("w", work_item_id=item.id),
        lambda: s.cancel(item.id, tenant="t1", reason="x"),
        lambda: s.dead_letter(item.id, reason="x"),
        lambda: s.mark_running(lease),
        lambda: s.renew(lease),
        lambda: s.defer(lease),
        lambda: s.retry(lease),
    ):
        with pytest.raises(InvalidTransition):
            attempt()
    h.advance(10_000)
    assert s.expire() == []
    assert s.recoverable(stale_after_s=0) == []
    assert s.get(item.id).state is WorkState.SUCCEEDED


# --- recovery ------------------------------------------------------------------------------------------------


def test_recoverable_finds_expired_leases_and_undelivered_ready_items(h: Harness) -> None:
    s = h.store
    never_dispatched = submit(s)
    dispatched = submit(s)
    leased_item = submit(s)
    lease_of(s, leased_item)
    backing_off = submit(s)
    s.retry(lease_of(s, backing_off), error="e")
    done = submit(s)
    s.commit(lease_of(s, done), Outcome.SUCCEEDED)
    waiting = submit(s, depends_on=(never_dispatched.id,))
    s.mark_dispatched([dispatched.id, never_dispatched.id])
    s.mark_dispatched([])
    h.advance(1.5)  # backoff of the first retry is at most 1 s
    assert ids(s.recoverable(stale_after_s=60)) == {backing_off.id}
    s.mark_dispatched([never_dispatched.id])
    h.advance(TTL)
    found = ids(s.recoverable(stale_after_s=30))
    assert found == {never_dispatched.id, dispatched.id, leased_item.id, backing_off.id}
    assert waiting.id not in found and done.id not in found
    assert len(s.recoverable(stale_after_s=30, limit=2)) == 2
    s.mark_dispatched([never_dispatched.id])
    assert never_dispatched.id not in ids(s.recoverable(stale_after_s=30))


def ids(items: list[WorkItem]) -> set[str]:
    return {item.id for item in items}


def test_recoverable_excludes_ready_items_whose_not_before_is_in_the_future(h: Harness) -> None:
    s = h.store
    item = submit(s)
    s.defer(lease_of(s, item), delay_s=100)
    assert s.recoverable(stale_after_s=0) == []
    h.advance(101)
    assert ids(s.recoverable(stale_after_s=0)) == {item.id}


# --- outcomes, reads, projection -----------------------------------------------------------------------------


def test_outcome_records_trace_the_whole_lifecycle(h: Harness) -> None:
    s = h.store
    item = submit(s)
    first = lease_of(s, item, "w1")
    s.mark_running(first)
    s.renew(first)
    s.retry(first, error="flaky")
    h.advance(2)
    second = lease_of(s, item, "w2")
    s.defer(second)
    third = lease_of(s, item, "w3")
    s.commit(third, Outcome.SUCCEEDED)
    records = s.outcomes(item.id)
    assert [(r.event, r.owner, r.lease_epoch) for r in records] == [
        ("submit", None, 0),
        ("claim", "w1", 1),
        ("running", "w1", 1),
        ("retry", "w1", 1),
        ("claim", "w2", 2),
        ("defer", "w2", 2),
        ("claim", "w3", 3),
        ("commit", "w3", 3),
    ]
    assert records[3].detail == "flaky" and records[3].outcome == "failed"
    assert [r.fencing_token for r in records[1:]] == sorted(r.fencing_token for r in records[1:])
    assert all(r.tenant == "t1" and r.work_item_id == item.id for r in records)
    assert [r.at for r in records] == sorted(r.at for r in records)
    assert s.outcomes("missing") == []


def test_reads_are_isolated_by_tenant_and_paginated_newest_first(h: Harness) -> None:
    s = h.store
    mine = [submit(s) for _ in range(5)]
    theirs = submit(s, tenant="t2")
    with pytest.raises(NotFound):
        s.get(theirs.id, tenant="t1")
    with pytest.raises(NotFound):
        s.get_payload(theirs.id, tenant="t1")
    with pytest.raises(NotFound):
        s.get("missing")
    page1 = s.list_items(tenant="t1", limit=2)
    page2 = s.list_items(tenant="t1", limit=2, after=page1[-1].id)
    page3 = s.list_items(tenant="t1", limit=2, after=page2[-1].id)
    assert [i.id for i in page1 + page2 + page3] == [i.id for i in reversed(mine)]
    assert s.list_items(tenant="t1", after=theirs.id) == []
    s.commit(lease_of(s, mine[0]), Outcome.SUCCEEDED)
    assert [i.id for i in s.list_items(tenant="t1", states=[WorkState.SUCCEEDED])] == [mine[0].id]
    assert len(s.list_items(tenant="t1", states=[WorkState.READY, WorkState.SUCCEEDED])) == 5
    assert [i.id for i in s.list_items(tenant="t2")] == [theirs.id]


def test_graph_jobs_projects_status_and_cancels(h: Harness) -> None:
    s = h.store
    item = submit(s, deadline=s.now() + timedelta(hours=1))
    lease = lease_of(s, item)
    status = graph_jobs(s, "status", job_id=item.id, tenant="t1")
    assert status["job_id"] == item.id
    assert status["state"] == "leased" and status["terminal"] is False
    assert (status["attempt"], status["max_attempts"], status["lease_epoch"]) == (1, 3, 1)
    assert status["outcome"] is None and status["error"] is None
    assert set(status["timestamps"]) >= {
        "created_at",
        "updated_at",
        "deadline",
        "lease_expires_at",
        "not_before",
    }
    datetime.fromisoformat(status["timestamps"]["created_at"])
    with pytest.raises(NotFound):
        graph_jobs(s, "status", job_id=item.id, tenant="t2")
    cancelled = graph_jobs(s, "cancel", job_id=item.id, tenant="t1")
    assert cancelled["state"] == "cancelled" and cancelled["changed"] is True
    assert cancelled["outcome"] == "cancelled"
    with pytest.raises(Cancelled):
        s.require_current(lease)
    again = graph_jobs(s, "cancel", job_id=item.id, tenant="t1")
    assert again["state"] == "cancelled" and again["changed"] is False
    with pytest.raises(ValueError, match="action"):
        graph_jobs(s, "delete", job_id=item.id, tenant="t1")


def test_now_is_the_store_clock(h: Harness) -> None:
    first = h.store.now()
    assert first.tzinfo is not None
    h.advance(3600)
    assert close_to(h.store.now(), first + timedelta(hours=1), 5)


# --- leader election, schema, opening ----------------------------------------------------------------------


def test_one_leader_at_a_time(h: Harness) -> None:
    a = h.store
    assert a.try_lead("recovery-sweep")
    assert a.try_lead("recovery-sweep")  # keeps it
    if h.backend == "memory":
        return
    b = h.open()
    assert not b.try_lead("recovery-sweep")
    assert b.try_lead("another-duty")
    a.close()
    assert b.try_lead("recovery-sweep")
    # close() hands the lead over before it returns, not once the server gets round to ending
    # the closed session: the next leader's first try must win, every time.
    for _ in range(20):
        successor = h.open()
        b.close()
        assert successor.try_lead("recovery-sweep")
        b = successor


def _fresh_store(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> WorkItemStore:
    """A store on a database of its own (these tests change the schema)."""
    if backend == "sqlite":
        return SqliteStore(tmp_path / "own.sqlite3", store_settings())
    return PostgresStore(request.getfixturevalue("postgres_dsn"), store_settings(), max_size=2)


@pytest.mark.parametrize("backend", DB_BACKENDS)
def test_an_older_schema_is_refused_until_migrated(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database is at the current version; the code is one version newer and refuses it."""
    current = _fresh_store(backend, request, tmp_path)
    assert current.migrate() == SCHEMA_VERSION
    assert current.migrate() == SCHEMA_VERSION  # idempotent
    current.close()
    store_class = {"sqlite": SqliteStore, "postgres": PostgresStore}[backend]
    newer = SCHEMA_VERSION + 1
    schema = store_class.schema
    steps = {**schema.steps, newer: ["CREATE TABLE agent_dispatch_probe (x integer)"]}
    monkeypatch.setattr(store_class, "schema", dataclasses.replace(schema, version=newer, steps=steps))
    stale = _fresh_store(backend, request, tmp_path)
    try:
        for call in (
            lambda: stale.get("x"),
            lambda: stale.claim("w"),
            lambda: stale.submit(SubmitRequest(tenant="t", kind="k", payload=b"")),
        ):
            with pytest.raises(
                SchemaOutdated,
                match=f"version {SCHEMA_VERSION}; .* needs {newer}: run agent-dispatch migrate",
            ):
                call()
        assert stale.migrate() == newer
        assert stale.migrate() == newer
        with pytest.raises(NotFound):
            stale.get("x")
    finally:
        stale.close()


@pytest.mark.parametrize("backend", DB_BACKENDS)
def test_an_empty_database_is_refused_until_migrated(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    store = _fresh_store(backend, request, tmp_path)
    try:
        with pytest.raises(SchemaOutdated, match=r"version 0.*run agent-dispatch migrate"):
            store.list_items(tenant="t")
        assert store.migrate() == SCHEMA_VERSION
        assert store.list_items(tenant="t") == []
    finally:
        store.close()


def test_open_store_picks_sqlite_without_a_database_uri(tmp_path: Path) -> None:
    store = open_store(store_settings(data_dir=tmp_path))
    try:
        assert isinstance(store, SqliteStore)
        assert store.path == tmp_path / "agent-dispatch.sqlite3"
        assert isinstance(store, WorkItemStore)
    finally:
        store.close()


@pytest.mark.postgres
def test_open_store_picks_postgres_with_a_database_uri(postgres_dsn: str, tmp_path: Path) -> None:
    store = open_store(store_settings(state_db_uri=postgres_dsn, data_dir=tmp_path))
    try:
        assert isinstance(store, PostgresStore)
        assert store.migrate() == SCHEMA_VERSION
        assert isinstance(store.now(), datetime)
        assert store.now().tzinfo == UTC
    finally:
        store.close()


def test_threads_racing_to_claim_commit_each_item_exactly_once(h: Harness) -> None:
    """Several threads share one store object (the in-process case for every backend)."""
    s = h.store
    items = {submit(s, tenant=f"t{i % 3}").id for i in range(120)}
    committed: list[str] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def work(owner: str) -> None:
        try:
            while (lease := s.claim(owner)) is not None:
                s.mark_running(lease)
                s.commit(lease, Outcome.SUCCEEDED)
                with lock:
                    committed.append(lease.work_item_id)
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(f"w{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
    assert sorted(committed) == sorted(items)
    tokens = [s.get(item_id).fencing_token for item_id in items]
    assert len(set(tokens)) == len(tokens)


# --- batched start and commit (the worker's fast path) -----------------------------------------------------


def started_of(s: WorkItemStore, item: WorkItem, owner: str = "w1") -> Lease:
    started = s.start_many(owner, [(item.id, item.tenant)])
    assert set(started) == {item.id}
    return started[item.id].lease


def test_start_many_leases_and_starts_ready_items_with_their_payloads(h: Harness) -> None:
    s = h.store
    a, b = submit(s, payload=b"a-payload"), submit(s, payload=b"b-payload")
    earlier = lease_of(s, submit(s))
    before = s.now()
    started = s.start_many("w1", [(a.id, "t1"), (b.id, "t1"), (a.id, "t1")], ttl_s=30)
    assert set(started) == {a.id, b.id}
    assert started[a.id].payload == b"a-payload" and started[b.id].payload == b"b-payload"
    tokens = set()
    for item in (a, b):
        lease = started[item.id].lease
        assert (lease.work_item_id, lease.tenant, lease.owner) == (item.id, "t1", "w1")
        assert (lease.lease_epoch, lease.attempt) == (1, 1)
        assert lease.fencing_token > earlier.fencing_token  # the same store-wide sequence as claim
        tokens.add(lease.fencing_token)
        assert close_to(lease.expires_at, before + timedelta(seconds=30), 2)
        got = s.get(item.id)
        assert got.state is WorkState.RUNNING
        assert (got.lease_owner, got.lease_epoch, got.fencing_token, got.attempt) == (
            "w1",
            1,
            lease.fencing_token,
            1,
        )
        assert got.lease_expires_at == lease.expires_at
        records = s.outcomes(item.id)
        assert [(r.event, r.owner, r.lease_epoch, r.fencing_token, r.detail) for r in records[1:]] == [
            ("claim", "w1", 1, lease.fencing_token, None),
            ("running", "w1", 1, lease.fencing_token, None),
        ]
        # Exactly the lease claim + mark_running would have given: the usual calls accept it.
        s.require_current(lease)
        assert s.mark_running(lease) == lease
        assert s.renew(lease).fencing_token == lease.fencing_token
    assert len(tokens) == 2
    assert s.start_many("w1", []) == {}
    default = started_of(s, submit(s))
    assert close_to(default.expires_at, s.now() + timedelta(seconds=TTL), 2)
    with pytest.raises(InvalidRequest):
        s.start_many("", [(submit(s).id, "t1")])
    with pytest.raises(InvalidRequest):
        s.start_many("w1", [(submit(s).id, "t1")], ttl_s=0)


def test_start_many_leaves_every_item_that_is_not_simply_claimable_untouched(h: Harness) -> None:
    s = h.store
    spent = submit(s, max_attempts=1)
    lease_of(s, spent)
    h.advance(TTL + 1)  # spent's lease has expired, but a reclaim would exceed its one attempt
    overdue = submit(s, deadline=s.now() + timedelta(seconds=5))
    foreign = submit(s, tenant="t2")
    backing_off = submit(s)
    s.defer(lease_of(s, backing_off), delay_s=100)
    held = submit(s)
    lease_of(s, held)
    running = submit(s)
    s.mark_running(lease_of(s, running))
    done = submit(s)
    s.commit(lease_of(s, done), Outcome.SUCCEEDED)
    cancelled = submit(s)
    s.cancel(cancelled.id, tenant="t1", reason="user asked")
    waiting = submit(s, depends_on=(running.id,))
    fine = submit(s)
    h.advance(10)  # past overdue's deadline; every lease above is still live
    untouched = [spent, overdue, backing_off, held, running, done, cancelled, waiting]
    snapshot = {item.id: (s.get(item.id), s.outcomes(item.id)) for item in [*untouched, foreign]}

    claims = [(item.id, "t1") for item in untouched] + [
        (foreign.id, "t1"),
        ("missing", "t1"),
        (fine.id, "t1"),
    ]
    started = s.start_many("w9", claims)

    assert set(started) == {fine.id}
    for item_id, (item, records) in snapshot.items():
        assert s.get(item_id) == item, item_id
        assert s.outcomes(item_id) == records, item_id
    # The one-by-one path still explains and handles each of them as before.
    assert s.claim("w9", work_item_id=spent.id) is None
    assert s.get(spent.id).state is WorkState.DEAD_LETTER
    with pytest.raises(TenantMismatch):
        s.claim("w9", work_item_id=foreign.id, tenant="t1")
    with pytest.raises(LeaseHeld):
        s.claim("w9", work_item_id=held.id, tenant="t1")
    with pytest.raises(InvalidTransition):
        s.claim("w9", work_item_id=done.id, tenant="t1")
    with pytest.raises(InvalidTransition, match="dependencies"):
        s.claim("w9", work_item_id=waiting.id, tenant="t1")
    assert s.claim("w9", work_item_id=backing_off.id, tenant="t1") is None
    assert [item.id for item in s.expire()] == [overdue.id]
    h.advance(100)  # backing_off is due now
    assert set(s.start_many("w9", [(backing_off.id, "t1")])) == {backing_off.id}


def test_start_many_reclaims_an_expired_lease_and_the_old_holder_is_fenced(h: Harness) -> None:
    s = h.store
    item = submit(s, payload=b"again")
    old = lease_of(s, item, "w1")
    s.mark_running(old)
    h.advance(TTL + 1)
    started = s.start_many("w2", [(item.id, "t1")])
    new = started[item.id].lease
    assert started[item.id].payload == b"again"
    assert (new.owner, new.lease_epoch, new.attempt) == ("w2", 2, 2)
    assert new.fencing_token > old.fencing_token
    claim, run = s.outcomes(item.id)[-2:]
    assert (claim.event, claim.owner, claim.detail) == (
        "claim",
        "w2",
        "reclaimed an expired lease held by w1",
    )
    assert (run.event, run.owner, run.lease_epoch) == ("running", "w2", 2)
    assert s.commit_many([(old, Outcome.SUCCEEDED, None)]) == {}
    for call in fenced_calls(s):
        with pytest.raises(Fenced):
            call(old)
    assert s.commit(new, Outcome.SUCCEEDED).item.state is WorkState.SUCCEEDED


def test_commit_many_commits_current_leases_with_their_records(h: Harness) -> None:
    s = h.store
    a, b, c = submit(s), submit(s), submit(s)
    leased = submit(s)
    started = s.start_many("w1", [(a.id, "t1"), (b.id, "t1"), (c.id, "t1")])
    la, lb = started[a.id].lease, started[b.id].lease
    ld = lease_of(s, leased)  # leased, not yet running: committable all the same
    long_error = "x" * (MAX_ERROR_CHARS + 500)
    committed = s.commit_many(
        [
            (la, Outcome.SUCCEEDED, None),
            (lb, Outcome.FAILED, long_error),
            (ld, Outcome.SUCCEEDED, "fine"),
            (la, Outcome.FAILED, "a repeat of a lease counts once"),
        ]
    )
    assert set(committed) == {a.id, b.id, leased.id}
    assert committed[a.id] == s.get(a.id)
    assert (committed[a.id].state, committed[a.id].outcome, committed[a.id].error) == (
        WorkState.SUCCEEDED,
        Outcome.SUCCEEDED,
        None,
    )
    assert committed[b.id].state is WorkState.FAILED and committed[b.id].outcome is Outcome.FAILED
    assert len(committed[b.id].error or "") == MAX_ERROR_CHARS  # bounded as commit bounds it
    assert committed[leased.id].state is WorkState.SUCCEEDED and committed[leased.id].error == "fine"
    assert s.get(c.id).state is WorkState.RUNNING
    for lease, outcome in ((la, Outcome.SUCCEEDED), (lb, Outcome.FAILED), (ld, Outcome.SUCCEEDED)):
        record = s.outcomes(lease.work_item_id)[-1]
        assert (record.event, record.outcome, record.owner) == ("commit", outcome.value, "w1")
        assert (record.lease_epoch, record.fencing_token) == (lease.lease_epoch, lease.fencing_token)
        assert events(s, lease.work_item_id).count("commit") == 1
    assert len(s.outcomes(b.id)[-1].detail or "") == MAX_ERROR_CHARS
    # Already committed: left out, and commit() still recognises the repeat.
    recorded = s.outcomes(a.id)
    assert s.commit_many([(la, Outcome.SUCCEEDED, None)]) == {}
    assert s.outcomes(a.id) == recorded
    assert s.commit(la, Outcome.SUCCEEDED).repeated
    assert s.commit(lb, Outcome.FAILED).repeated
    assert s.commit_many([]) == {}


def test_commit_many_leaves_stale_leases_and_items_with_dependents_to_commit(h: Harness) -> None:
    s = h.store
    expired_item = submit(s)
    expired = started_of(s, expired_item)
    h.advance(TTL + 1)
    parent, failing_parent, cancelled_item, ok = submit(s), submit(s), submit(s), submit(s)
    child = submit(s, depends_on=(parent.id,))
    failing_child = submit(s, depends_on=(failing_parent.id,))
    started = s.start_many("w1", [(i.id, "t1") for i in (parent, failing_parent, cancelled_item, ok)])
    lp, lf, lc, lok = (started[i.id].lease for i in (parent, failing_parent, cancelled_item, ok))
    s.cancel(cancelled_item.id, tenant="t1", reason="user asked")
    forged_owner = dataclasses.replace(lok, owner="intruder")
    forged_tenant = dataclasses.replace(lok, tenant="t2")
    stale = [expired_item, parent, failing_parent, cancelled_item]
    snapshot = {item.id: (s.get(item.id), s.outcomes(item.id)) for item in stale}

    committed = s.commit_many(
        [
            (expired, Outcome.SUCCEEDED, None),
            (lp, Outcome.SUCCEEDED, None),
            (lf, Outcome.FAILED, "boom"),
            (lc, Outcome.SUCCEEDED, None),
            (forged_owner, Outcome.FAILED, None),
            (forged_tenant, Outcome.FAILED, None),
            (lok, Outcome.SUCCEEDED, None),
        ]
    )

    assert set(committed) == {ok.id}
    assert committed[ok.id].state is WorkState.SUCCEEDED
    for item_id, (item, records) in snapshot.items():
        assert s.get(item_id) == item, item_id
        assert s.outcomes(item_id) == records, item_id
    # commit() of each one left out behaves as it always has.
    with pytest.raises(LeaseExpired):
        s.commit(expired, Outcome.SUCCEEDED)
    with pytest.raises(Cancelled):
        s.commit(lc, Outcome.SUCCEEDED)
    with pytest.raises(Fenced):
        s.commit(forged_owner, Outcome.FAILED)
    with pytest.raises(TenantMismatch):
        s.commit(forged_tenant, Outcome.FAILED)
    assert s.commit(lp, Outcome.SUCCEEDED).item.state is WorkState.SUCCEEDED
    assert s.get(child.id).state is WorkState.READY
    assert s.commit(lf, Outcome.FAILED, error="boom").item.state is WorkState.FAILED
    assert s.get(failing_child.id).state is WorkState.CANCELLED


def test_threads_racing_to_start_the_same_batch_start_each_item_exactly_once(h: Harness) -> None:
    """Every thread asks for the same batch at the same moment: each item is started by one of them."""
    s = h.store
    items = [submit(s, tenant=f"t{i % 3}") for i in range(64)]
    batches = [[(item.id, item.tenant) for item in items[i : i + 8]] for i in range(0, len(items), 8)]
    started: list[Lease] = []
    committed: list[str] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def work(owner: str) -> None:
        try:
            for batch in batches:
                barrier.wait(timeout=60)
                got = s.start_many(owner, batch)
                done = s.commit_many([(turn.lease, Outcome.SUCCEEDED, None) for turn in got.values()])
                assert set(done) == set(got)
                with lock:
                    started.extend(turn.lease for turn in got.values())
                    committed.extend(done)
        except BaseException as exc:  # reported below
            failures.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(f"w{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
    assert len(committed) == len(set(committed))  # no item started (and committed) twice
    for item in items:
        if item.id not in committed:  # skipped by every thread (locked by another's statement)
            started.append(started_of(s, item))
    assert len({lease.fencing_token for lease in started}) == len(started) == len(items)
    assert all(s.get(item.id).attempt == 1 for item in items)
