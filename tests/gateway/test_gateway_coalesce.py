"""The gateway's group commit: concurrent single-turn submissions admitted in shared batches.

The batcher's logic is checked alone (Hypothesis, an in-memory admit function: pure scheduling);
then the whole path on the real stores and queues, where what matters is that every client
still gets the answer it would have had alone.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_dispatch.errors import BackendUnavailable, QueueFull
from agent_dispatch.gateway import _coalesce
from agent_dispatch.gateway import _metrics as m
from agent_dispatch.gateway._coalesce import Outcome, SubmitCoalescer
from agent_dispatch.gateway.service import JobService, ServiceError
from agent_dispatch.models import SubmitRequest
from tests.gateway._harness import BACKENDS, Running, gateway_settings, running_gateway


class Boom(RuntimeError):
    pass


def _request(n: int) -> SubmitRequest:
    return SubmitRequest(tenant=f"t{n % 3}", kind="k", payload=str(n).encode(), idempotency_key=f"key-{n}")


@settings(max_examples=60, deadline=None)
@given(
    waves=st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=4),
    failing=st.sets(st.integers(min_value=1, max_value=20), max_size=3),
    refused=st.sets(st.integers(min_value=0, max_value=500), max_size=20),
)
def test_each_request_gets_its_own_outcome_within_the_batching_bounds(
    waves: list[int], failing: set[int], refused: set[int]
) -> None:
    """Waves of concurrent submissions: every request gets the outcome computed for it (or its
    batch's exception), no batch is over MAX_SIZE, no more than IN_FLIGHT run at once, and a
    request that finds the batcher idle is admitted at once, alone."""
    batches: list[list[int]] = []
    running = 0
    most_running = 0

    async def admit_many(requests: Sequence[SubmitRequest]) -> Sequence[Outcome]:
        nonlocal running, most_running
        number = len(batches)
        batches.append([int(r.payload) for r in requests])
        running += 1
        most_running = max(most_running, running)
        try:
            await asyncio.sleep(0.001)
            if number in failing:
                raise Boom(number)
            return [
                QueueFull(f"no room for {int(r.payload)}")
                if int(r.payload) in refused
                else replace(r, kind=f"done-{int(r.payload)}")  # type: ignore[list-item]
                for r in requests
            ]
        finally:
            running -= 1

    async def scenario() -> None:
        coalescer = SubmitCoalescer(admit_many)
        first = await coalescer.run(_request(10_000))  # idle: sent at once, alone
        assert batches == [[10_000]]
        assert first == replace(_request(10_000), kind="done-10000")
        offset = 0
        for size in waves:
            numbers = list(range(offset, offset + size))
            offset += size
            answers = await asyncio.gather(
                *(coalescer.run(_request(n)) for n in numbers), return_exceptions=True
            )
            for n, answer in zip(numbers, answers, strict=True):
                batch_no = next(i for i, b in enumerate(batches) if n in b)
                if batch_no in failing:
                    assert isinstance(answer, Boom) and answer.args == (batch_no,)
                elif n in refused:
                    assert isinstance(answer, QueueFull) and str(answer) == f"no room for {n}"
                else:
                    assert answer == replace(_request(n), kind=f"done-{n}")
        sent = [n for batch in batches for n in batch]
        assert sorted(sent) == sorted([10_000, *range(offset)])  # each request in exactly one batch
        assert all(1 <= len(b) <= _coalesce.MAX_SIZE for b in batches)
        assert most_running <= _coalesce.IN_FLIGHT

    asyncio.run(scenario())


def test_a_client_that_goes_away_does_not_cancel_the_others_batch() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()

        async def admit_many(requests: Sequence[SubmitRequest]) -> Sequence[Outcome]:
            await gate.wait()
            return list(requests)  # type: ignore[arg-type]

        coalescer = SubmitCoalescer(admit_many)
        leaving = asyncio.ensure_future(coalescer.run(_request(1)))
        staying = asyncio.ensure_future(coalescer.run(_request(2)))
        await asyncio.sleep(0.01)
        leaving.cancel()
        gate.set()
        assert await staying == _request(2)
        with pytest.raises(asyncio.CancelledError):
            await leaving

    asyncio.run(scenario())


# --- on the real backends ------------------------------------------------------------------------

CLIENTS = 24
PER_CLIENT = 12
BOUND = 150


@pytest.fixture(params=BACKENDS)
def crowded_gateway(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    dsn = str(request.getfixturevalue("postgres_dsn")) if request.param == "postgres" else None
    settings = gateway_settings(request.param, tmp_path / "gw", dsn, max_depth=BOUND)
    with running_gateway(settings) as gw:
        yield gw


def _sizes_observed() -> tuple[float, float]:
    sample = {s.name: s.value for metric in m.SUBMIT_BATCH_SIZE.collect() for s in metric.samples}
    return sample["agent_dispatch_gateway_submit_batch_size_count"], sample[
        "agent_dispatch_gateway_submit_batch_size_sum"
    ]


def test_concurrent_clients_get_what_each_would_get_alone(crowded_gateway: Running) -> None:
    """24 clients at once: fresh keys, replays of each other's keys, a key reused with another
    body, more turns than the bound. Each answer is right for its own request, and the store holds
    exactly the turns answered 202 created:true."""
    gw = crowded_gateway
    count_before, sum_before = _sizes_observed()
    answers: list[tuple[str, dict[str, Any], int, dict[str, Any]]] = []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)

    def client(c: int) -> None:
        start.wait()
        for i in range(PER_CLIENT):
            # Every third request replays the previous client's key with the same body; every
            # seventh reuses it with a different body (a conflict, unless it came first).
            n = c * PER_CLIENT + i
            key, body = f"k-{n}", {"kind": "t", "payload": {"n": n}}
            if i % 3 == 2:
                key, body = (
                    f"k-{((c - 1) % CLIENTS) * PER_CLIENT + i}",
                    {
                        "kind": "t",
                        "payload": {"n": ((c - 1) % CLIENTS) * PER_CLIENT + i},
                    },
                )
            if i % 7 == 6:
                body = {"kind": "t", "payload": {"other": n}}
            reply = gw.submit(body, key=key)
            with lock:
                answers.append((key, body, reply.status, reply.json()))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(answers) == CLIENTS * PER_CLIENT

    statuses = Counter(status for _, _, status, _ in answers)
    assert set(statuses) <= {202, 409, 429}, statuses
    assert statuses[429] > 0  # more distinct turns than the bound
    created = [(key, body, a) for key, body, status, a in answers if status == 202 and a["created"]]
    # One job per key, created once; the key names it whatever the answer.
    assert len({key for key, _, _ in created}) == len(created)
    first_body = {key: body for key, body, _ in created}
    jobs = {key: a["job_id"] for key, _, a in created}
    for key, body, status, answer in answers:
        if status == 202 and not answer["created"]:
            assert jobs.get(key) == answer["job_id"] and first_body[key] == body
        elif status == 409:
            assert answer["error"] == "idempotency_conflict"
            assert key in first_body and first_body[key] != body
        elif status == 429:
            assert answer["error"] == "queue_full"
    # Nothing stored but what was answered as created, and the bound held.
    stored = gw.store.list_items(tenant="tenant-a", limit=1000)
    assert sorted(item.id for item in stored) == sorted(jobs.values())
    assert len(jobs) <= BOUND
    assert gw.transport.depth() == len(jobs)
    # Every single-turn submission went through the batcher.
    count_after, sum_after = _sizes_observed()
    assert sum_after - sum_before == len(answers)
    assert 1 <= count_after - count_before <= len(answers)


class _Unavailable:
    """An admission whose database is gone: every call fails as a whole."""

    def enqueue(self, request: SubmitRequest) -> Any:
        raise BackendUnavailable("database went away")

    def enqueue_many(self, requests: Sequence[SubmitRequest]) -> Any:
        raise BackendUnavailable("database went away")


@pytest.mark.parametrize("size", [1, 5])
def test_a_failure_of_the_whole_batch_is_each_requests_own_answer(size: int, tmp_path: Path) -> None:
    """When the store fails a whole batch, each request gets the 503 it would have had alone."""
    service = JobService(gateway_settings("sqlite", tmp_path, None), store=None, admission=_Unavailable)  # type: ignore[arg-type]
    outcomes = service.admit_many([_request(n) for n in range(size)])
    assert len(outcomes) == size
    for outcome in outcomes:
        assert isinstance(outcome, BackendUnavailable)
        with pytest.raises(ServiceError) as refused:
            service.answer(outcome)
        assert refused.value.status == 503 and refused.value.code == "unavailable"


def _reads_observed() -> tuple[float, float]:
    sample = {s.name: s.value for metric in m.STATUS_READ_BATCH_SIZE.collect() for s in metric.samples}
    return sample["agent_dispatch_gateway_status_read_batch_size_count"], sample[
        "agent_dispatch_gateway_status_read_batch_size_sum"
    ]


def test_concurrent_status_reads_each_see_only_their_own_tenants_jobs(crowded_gateway: Running) -> None:
    """Status reads share store reads: 16 clients of two tenants read at once their own jobs,
    each other's and ids that name nothing. Each answer is the job as the store has it, or the 404
    an absent job gets (another tenant's job is absent to them), whoever shared the read."""
    gw = crowded_gateway
    jobs = {
        tenant: [
            gw.submit({"kind": "t", "payload": {"n": n}}, tenant=tenant).json()["job_id"] for n in range(6)
        ]
        for tenant in ("tenant-a", "tenant-b")
    }
    unknown = ["0" * 32, "not-a-job", "x" * 300]
    count_before, sum_before = _reads_observed()
    answers: list[tuple[str, str, int, dict[str, Any]]] = []
    lock = threading.Lock()
    start = threading.Barrier(16)

    def client(c: int) -> None:
        tenant = ("tenant-a", "tenant-b")[c % 2]
        asks = [*jobs["tenant-a"], *jobs["tenant-b"], *unknown]
        start.wait()
        for job_id in asks[c % 5 :] + asks[: c % 5]:
            reply = gw.call("GET", f"/api/graph/jobs/{job_id}", tenant=tenant)
            with lock:
                answers.append((tenant, job_id, reply.status, reply.json()))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(answers) == 16 * (12 + len(unknown))
    for tenant, job_id, status, answer in answers:
        if job_id in jobs[tenant]:
            assert status == 200, answer
            item = gw.store.get(job_id)
            assert (answer["job_id"], answer["tenant"], answer["state"]) == (job_id, tenant, item.state.value)
        else:
            assert status == 404 and answer["error"] == "not_found", (tenant, job_id, answer)
    count_after, sum_after = _reads_observed()
    # Every read went through the batcher.
    assert sum_after - sum_before == len(answers)
    assert 1 <= count_after - count_before <= sum_after - sum_before
