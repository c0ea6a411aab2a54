"""The idempotency contract over HTTP (single and batch endpoint) on SQLite, PostgreSQL and Kafka.

docs/gateway.md, "Idempotency and refusals": a refusal (429 for the bound, 503 for an unknown
depth or an unreachable broker) keeps nothing under the key, so a retry with the same key is a
fresh attempt at admission, admitted as the same job once there is room; a replay of an accepted
key gets its job (``created: false``) whatever the depth; a key reused with a different body is
409; a key never names two jobs, and on Kafka never more than one message is admitted for it.
The bound counts accepted, unfinished turns: room comes back when a turn finishes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from agent_dispatch import dispatch
from agent_dispatch.models import deterministic_id
from tests.gateway._contract import (
    BACKENDS,
    TENANT,
    WAIT_S,
    body,
    finish_one,
    job_ids,
    messages_per_item,
    until_accepted,
)
from tests.gateway._harness import SIGNING_KEY, Running, running_gateway

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def full_gateway(contract_settings: Any) -> Iterator[Running]:
    with running_gateway(contract_settings(max_depth=2)) as gw:
        yield gw


def test_a_retry_after_429_is_admitted_once_there_is_room(
    full_gateway: Running, contract_backend: str
) -> None:
    gw, backend = full_gateway, contract_backend
    first = gw.submit(body("a"), key="a")
    assert first.status == 202 and first.json()["created"] is True
    assert gw.submit(body("b"), key="b").status == 202
    refused = gw.submit(body("c"), key="c")
    assert refused.status == 429, refused.body
    # Nothing is left under the refused key: no job, not even a cancelled one.
    job_c = deterministic_id(TENANT, "c")
    assert gw.call("GET", f"/api/graph/jobs/{job_c}").status == 404
    # A replay of an accepted key is answered with its job while the queue is still full.
    replay = gw.submit(body("a"), key="a")
    assert replay.status == 202, replay.body
    assert (replay.json()["job_id"], replay.json()["created"]) == (first.json()["job_id"], False)

    finish_one(gw)
    accepted, seen = until_accepted(gw, "c", "c")
    assert accepted["job_id"] == job_c and accepted["created"] is True and accepted["state"] == "ready"
    assert set(seen) <= {202, 429}
    again = gw.submit(body("c"), key="c")
    assert again.status == 202 and again.json()["created"] is False
    assert sorted(job_ids(gw)) == sorted({first.json()["job_id"], deterministic_id(TENANT, "b"), job_c})
    if backend == "kafka":
        assert messages_per_item(gw) == {
            first.json()["job_id"]: 1,
            deterministic_id(TENANT, "b"): 1,
            job_c: 1,
        }


def test_concurrent_retries_of_one_key_make_one_job_and_one_admission(
    full_gateway: Running, contract_backend: str
) -> None:
    gw, backend = full_gateway, contract_backend
    assert gw.submit(body("x"), key="x").status == 202
    assert gw.submit(body("y"), key="y").status == 202
    answers: list[tuple[dict[str, Any], Counter[int]]] = []
    errors: list[BaseException] = []

    def client() -> None:
        try:
            answers.append(until_accepted(gw, "same", "same"))
        except BaseException as exc:
            errors.append(exc)

    clients = [threading.Thread(target=client) for _ in range(6)]
    for thread in clients:
        thread.start()
    time.sleep(1.0)  # every client is being refused: the queue is full
    finish_one(gw)
    for thread in clients:
        thread.join(timeout=WAIT_S + 10)
    assert not errors, errors
    assert len(answers) == 6
    job = deterministic_id(TENANT, "same")
    assert {handle["job_id"] for handle, _ in answers} == {job}
    assert sum(handle["created"] for handle, _ in answers) == 1
    assert sorted(job_ids(gw)) == sorted({deterministic_id(TENANT, "x"), deterministic_id(TENANT, "y"), job})
    assert gw.call("GET", f"/api/graph/jobs/{job}").json()["state"] == "ready"
    if backend == "kafka":
        assert messages_per_item(gw)[job] == 1


def test_a_refused_batch_turn_can_be_retried_and_replays_are_answered(full_gateway: Running) -> None:
    gw = full_gateway
    turns = [{**body(f"t{i}"), "idempotency_key": f"bt{i}"} for i in range(4)]
    reply = gw.call("POST", "/api/turns:batch", body={"turns": turns})
    statuses = [r["status"] for r in reply.json()["results"]]
    assert statuses == [202, 202, 429, 429], reply.body
    for key in ("bt2", "bt3"):
        assert gw.call("GET", f"/api/graph/jobs/{deterministic_id(TENANT, key)}").status == 404
    # The same batch again while full: the accepted turns are replayed, the others still refused.
    again = gw.call("POST", "/api/turns:batch", body={"turns": turns}).json()["results"]
    assert [r["status"] for r in again] == [202, 202, 429, 429]
    assert [r["created"] for r in again[:2]] == [False, False]
    finish_one(gw)
    finish_one(gw)
    # Retrying the whole batch until every turn is in (the room may come back one slot at a time).
    created: Counter[int] = Counter()
    deadline = time.monotonic() + WAIT_S
    while True:
        results = gw.call("POST", "/api/turns:batch", body={"turns": turns}).json()["results"]
        created.update(r["index"] for r in results if r["status"] == 202 and r["created"])
        if [r["status"] for r in results] == [202] * 4:
            break
        assert {r["status"] for r in results} <= {202, 429}, results
        assert time.monotonic() < deadline, results
        time.sleep(0.1)
    assert created == {2: 1, 3: 1}
    assert len(job_ids(gw)) == 4


@pytest.mark.parametrize("contract_backend", [BACKENDS[2]], indirect=True)
def test_kafka_delivery_failure_leaves_the_turn_for_the_sweep_and_a_retry_finds_it(
    contract_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker did not confirm the message: 503, the outcome is unknown. The WorkItem stays
    ready (not cancelled); a retry with the same key returns it, and the sweep admits it once."""
    from agent_dispatch.transports.kafka import DeliveryFailed, KafkaTransport

    with running_gateway(contract_settings(max_depth=10)) as gw:
        assert isinstance(gw.transport, KafkaTransport)
        real = gw.transport._produce

        def fail_once(turns: Any) -> None:
            monkeypatch.setattr(gw.transport, "_produce", real)
            gw.transport._release_reserved(len(turns))
            raise DeliveryFailed("kafka did not confirm 1 of 1 turns in time")

        monkeypatch.setattr(gw.transport, "_produce", fail_once)
        failed = gw.submit(body("lost"), key="lost")
        assert failed.status == 503 and failed.json()["error"] == "unavailable", failed.body
        job = deterministic_id(TENANT, "lost")
        assert gw.call("GET", f"/api/graph/jobs/{job}").json()["state"] == "ready"
        retry = gw.submit(body("lost"), key="lost")
        assert retry.status == 202 and retry.json()["created"] is False and retry.json()["job_id"] == job
        # The recovery sweep re-drives the undispatched item: exactly one message for it.
        assert (
            dispatch.redrive(
                gw.store,
                gw.transport,
                settings=gw.settings,
                signing_key=SIGNING_KEY.encode(),
                stale_after_s=0,
            )
            == 1
        )
        assert messages_per_item(gw) == {job: 1}
        assert finish_one(gw) == job


def test_a_key_reused_with_a_different_body_is_409_full_or_not(full_gateway: Running) -> None:
    gw = full_gateway
    assert gw.submit(body("a"), key="a").status == 202
    for _ in range(2):  # with room, then with the queue full
        changed = gw.submit(body("not a"), key="a")
        assert changed.status == 409, changed.body
        reply = gw.call(
            "POST",
            "/api/turns:batch",
            body={
                "turns": [{**body("not a"), "idempotency_key": "a"}, {**body("a"), "idempotency_key": "a"}]
            },
        )
        results = reply.json()["results"]
        assert [r["status"] for r in results] == [409, 202], results
        assert results[1]["created"] is False
        assert gw.submit(body("b"), key="b").status in (202, 429)
    assert sorted(job_ids(gw)) == sorted({deterministic_id(TENANT, "a"), deterministic_id(TENANT, "b")})


class _Outage:
    """Makes the depth unknown: on Kafka the real broker stops; on the database queues the depth
    counter row goes (so the pre-check and the admission in the submit's transaction both find
    the depth unknown), and comes back with its value afterwards."""

    def __init__(self, gw: Running, backend: str, request: pytest.FixtureRequest) -> None:
        self.gw, self.backend, self.request = gw, backend, request
        self.depth = 0

    def __enter__(self) -> None:
        if self.backend == "kafka":
            self.request.getfixturevalue("kafka_broker").stop()
            time.sleep(0.3)  # past the probe cache: only a fresh probe may answer
            return
        self.depth = self.gw.transport.depth()
        self.gw.execute_in_database("DELETE FROM agent_dispatch_queue_depth")

    def __exit__(self, *exc: object) -> None:
        if self.backend == "kafka":
            self.request.getfixturevalue("kafka_broker").start()
        else:
            self.gw.execute_in_database(
                f"INSERT INTO agent_dispatch_queue_depth (singleton, depth) VALUES (true, {self.depth})"
            )


def test_a_503_keeps_nothing_and_a_retry_is_a_fresh_attempt(
    contract_settings: Any, contract_backend: str, request: pytest.FixtureRequest
) -> None:
    backend = contract_backend
    with running_gateway(contract_settings(max_depth=5)) as gw:
        accepted = gw.submit(body("a"), key="a")
        assert accepted.status == 202
        job_b = deterministic_id(TENANT, "b")
        with _Outage(gw, backend, request):
            refused = gw.submit(body("b"), key="b")
            assert refused.status == 503 and refused.json()["error"] == "depth_unavailable", refused.body
            assert gw.call("GET", f"/api/graph/jobs/{job_b}").status == 404
            # A replay of the accepted key is answered from the store, depth unknown or not.
            replay = gw.submit(body("a"), key="a")
            assert replay.status == 202 and replay.json()["created"] is False, replay.body
            results = gw.call(
                "POST",
                "/api/turns:batch",
                body={
                    "turns": [{**body("a"), "idempotency_key": "a"}, {**body("b"), "idempotency_key": "b"}]
                },
            ).json()["results"]
            assert [(r["status"], r.get("created")) for r in results] == [(202, False), (503, None)], results
            assert gw.call("GET", f"/api/graph/jobs/{job_b}").status == 404
        # Back: the retry with the refused key is a fresh attempt (created, not a cancelled item).
        deadline = time.monotonic() + WAIT_S
        while (retry := gw.submit(body("b"), key="b")).status == 503:
            assert time.monotonic() < deadline, "still unavailable"
            time.sleep(0.5)
        assert retry.status == 202 and retry.json()["created"] is True, retry.body
        assert retry.json()["job_id"] == job_b and retry.json()["state"] == "ready"
        if backend == "kafka":
            counts = messages_per_item(gw)
            assert counts[job_b] == 1 and counts[deterministic_id(TENANT, "a")] == 1


def test_a_turn_waiting_on_a_dependency_counts_under_the_bound(full_gateway: Running) -> None:
    """Accepted and unfinished, though it has no delivery yet: it takes room like any other."""
    gw = full_gateway
    parent = gw.submit(body("parent"), key="parent").json()
    child = gw.submit({**body("child"), "depends_on": [parent["job_id"]]}, key="child")
    assert child.status == 202 and child.json()["state"] == "submitted", child.body
    refused = gw.submit(body("third"), key="third")
    assert refused.status == 429, refused.body
    assert gw.call("GET", f"/api/graph/jobs/{deterministic_id(TENANT, 'third')}").status == 404
    # The parent finishes and releases the child: one unfinished turn, room for one more.
    assert finish_one(gw) == parent["job_id"]
    assert until_accepted(gw, "third", "third")[0]["created"] is True
    assert gw.submit(body("fourth"), key="fourth").status == 429
