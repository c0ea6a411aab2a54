"""Retries with the same Idempotency-Key after a refusal, over HTTP, on SQLite, PostgreSQL and Kafka.

The contract (docs/gateway.md, "Idempotency and refusals"): a 429 or a 503 for an unmeasurable
depth leaves nothing under the key, so a retry with the same key is admitted once there is room,
as the same job; a replay of an accepted key gets its job even while the queue is full; a key
never names two jobs, and on Kafka never more than one message is admitted for it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch import dispatch
from agent_dispatch.models import deterministic_id
from agent_dispatch.settings import Settings
from tests.gateway._harness import SIGNING_KEY, Running, gateway_settings, running_gateway

pytestmark = pytest.mark.timeout(180)

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("kafka", id="kafka", marks=[pytest.mark.kafka, pytest.mark.postgres]),
]
TENANT = "tenant-a"
WAIT_S = 60.0


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def settings_for(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    def make(**overrides: Any) -> Settings:
        if backend == "sqlite":
            return gateway_settings("sqlite", tmp_path / "gw", None, **overrides)
        dsn = str(request.getfixturevalue("postgres_dsn"))
        if backend == "postgres":
            return gateway_settings("postgres", tmp_path / "gw", dsn, **overrides)
        topic = str(request.getfixturevalue("kafka_topic_name"))
        return gateway_settings(
            "kafka",
            tmp_path / "gw",
            None,
            state_db_uri=dsn,
            kafka_bootstrap_servers=request.getfixturevalue("kafka_bootstrap"),
            kafka_topic=topic,
            kafka_group=f"g.{topic}",
            partitions=1,
            **overrides,
        )

    return make


@pytest.fixture
def full_gateway(settings_for: Any) -> Iterator[Running]:
    with running_gateway(settings_for(max_depth=2)) as gw:
        yield gw


def _body(name: str) -> dict[str, Any]:
    return {"kind": "t", "payload": {"name": name}}


def _drain_one(gw: Running) -> str:
    """A worker takes one delivery and acknowledges it: one slot of room under the bound."""
    deadline = time.monotonic() + WAIT_S
    while True:
        got = gw.transport.claim("drain", max_items=1, wait_s=1.0)
        if got:
            gw.transport.ack(got[0].receipt)
            return got[0].work_item_id
        assert time.monotonic() < deadline, "no delivery to drain"


def _until_accepted(gw: Running, name: str, key: str) -> tuple[dict[str, Any], Counter[int]]:
    """Retry with the same key (as a client would after 429) until it is accepted."""
    seen: Counter[int] = Counter()
    deadline = time.monotonic() + WAIT_S
    while True:
        reply = gw.submit(_body(name), key=key)
        seen[reply.status] += 1
        if reply.status == 202:
            return reply.json(), seen
        assert reply.status == 429, reply.body
        assert time.monotonic() < deadline, f"{key} still refused: {seen}"
        time.sleep(0.1)


def _messages_per_item(gw: Running) -> Counter[str]:
    """Kafka: how many messages were ever admitted for each WorkItem (read with a fresh group)."""
    from confluent_kafka import Consumer, TopicPartition

    from agent_dispatch.transports.kafka import WORK_ITEM_HEADER

    settings = gw.settings
    consumer = Consumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap_servers,
            "group.id": f"count.{settings.kafka_topic}.{time.monotonic_ns()}",
            "enable.auto.commit": False,
        }
    )
    try:
        part = TopicPartition(settings.kafka_topic, 0, 0)
        _, high = consumer.get_watermark_offsets(part, timeout=10)
        consumer.assign([part])
        counts: Counter[str] = Counter()
        read = 0
        deadline = time.monotonic() + WAIT_S
        while read < high:
            assert time.monotonic() < deadline, f"read {read} of {high} messages"
            message = consumer.poll(1.0)
            if message is None or message.error() is not None:
                continue
            read += 1
            headers = dict(message.headers() or [])
            counts[headers[WORK_ITEM_HEADER].decode()] += 1
        return counts
    finally:
        consumer.close()


def _job_ids(gw: Running) -> list[str]:
    return [job["job_id"] for job in gw.call("GET", "/api/graph/jobs?limit=100").json()["jobs"]]


def test_a_retry_after_429_is_admitted_once_there_is_room(full_gateway: Running, backend: str) -> None:
    gw = full_gateway
    first = gw.submit(_body("a"), key="a")
    assert first.status == 202 and first.json()["created"] is True
    assert gw.submit(_body("b"), key="b").status == 202
    refused = gw.submit(_body("c"), key="c")
    assert refused.status == 429, refused.body
    # Nothing is left under the refused key: no job, not even a cancelled one.
    job_c = deterministic_id(TENANT, "c")
    assert gw.call("GET", f"/api/graph/jobs/{job_c}").status == 404
    # A replay of an accepted key is answered with its job while the queue is still full.
    replay = gw.submit(_body("a"), key="a")
    assert replay.status == 202, replay.body
    assert (replay.json()["job_id"], replay.json()["created"]) == (first.json()["job_id"], False)

    _drain_one(gw)
    accepted, seen = _until_accepted(gw, "c", "c")
    assert accepted["job_id"] == job_c and accepted["created"] is True and accepted["state"] == "ready"
    assert set(seen) <= {202, 429}
    again = gw.submit(_body("c"), key="c")
    assert again.status == 202 and again.json()["created"] is False
    assert sorted(_job_ids(gw)) == sorted({first.json()["job_id"], deterministic_id(TENANT, "b"), job_c})
    if backend == "kafka":
        assert _messages_per_item(gw) == {
            first.json()["job_id"]: 1,
            deterministic_id(TENANT, "b"): 1,
            job_c: 1,
        }


def test_concurrent_retries_of_one_key_make_one_job_and_one_admission(
    full_gateway: Running, backend: str
) -> None:
    gw = full_gateway
    assert gw.submit(_body("x"), key="x").status == 202
    assert gw.submit(_body("y"), key="y").status == 202
    answers: list[tuple[dict[str, Any], Counter[int]]] = []
    errors: list[BaseException] = []

    def client() -> None:
        try:
            answers.append(_until_accepted(gw, "same", "same"))
        except BaseException as exc:
            errors.append(exc)

    clients = [threading.Thread(target=client) for _ in range(6)]
    for thread in clients:
        thread.start()
    time.sleep(1.0)  # every client is being refused: the queue is full
    _drain_one(gw)
    for thread in clients:
        thread.join(timeout=WAIT_S + 10)
    assert not errors, errors
    assert len(answers) == 6
    job = deterministic_id(TENANT, "same")
    assert {handle["job_id"] for handle, _ in answers} == {job}
    assert sum(handle["created"] for handle, _ in answers) == 1
    assert sorted(_job_ids(gw)) == sorted({deterministic_id(TENANT, "x"), deterministic_id(TENANT, "y"), job})
    assert gw.call("GET", f"/api/graph/jobs/{job}").json()["state"] == "ready"
    if backend == "kafka":
        assert _messages_per_item(gw)[job] == 1


def test_a_refused_batch_turn_can_be_retried_and_replays_are_answered(full_gateway: Running) -> None:
    gw = full_gateway
    turns = [{**_body(f"t{i}"), "idempotency_key": f"bt{i}"} for i in range(4)]
    reply = gw.call("POST", "/api/turns:batch", body={"turns": turns})
    statuses = [r["status"] for r in reply.json()["results"]]
    assert statuses == [202, 202, 429, 429], reply.body
    for key in ("bt2", "bt3"):
        assert gw.call("GET", f"/api/graph/jobs/{deterministic_id(TENANT, key)}").status == 404
    # The same batch again while full: the accepted turns are replayed, the others still refused.
    again = gw.call("POST", "/api/turns:batch", body={"turns": turns}).json()["results"]
    assert [r["status"] for r in again] == [202, 202, 429, 429]
    assert [r["created"] for r in again[:2]] == [False, False]
    _drain_one(gw)
    _drain_one(gw)
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
    assert len(_job_ids(gw)) == 4


@pytest.mark.parametrize("backend", [BACKENDS[2]], indirect=True)
def test_kafka_delivery_failure_leaves_the_turn_for_the_sweep_and_a_retry_finds_it(
    settings_for: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker did not confirm the message: 503, the outcome is unknown. The WorkItem stays
    ready (not cancelled); a retry with the same key returns it, and the sweep admits it once."""
    from agent_dispatch.transports.kafka import DeliveryFailed, KafkaTransport

    with running_gateway(settings_for(max_depth=10)) as gw:
        assert isinstance(gw.transport, KafkaTransport)
        real = gw.transport._produce

        def fail_once(turns: Any) -> None:
            monkeypatch.setattr(gw.transport, "_produce", real)
            gw.transport._release_reserved(len(turns))
            raise DeliveryFailed("kafka did not confirm 1 of 1 turns in time")

        monkeypatch.setattr(gw.transport, "_produce", fail_once)
        failed = gw.submit(_body("lost"), key="lost")
        assert failed.status == 503 and failed.json()["error"] == "unavailable", failed.body
        job = deterministic_id(TENANT, "lost")
        assert gw.call("GET", f"/api/graph/jobs/{job}").json()["state"] == "ready"
        retry = gw.submit(_body("lost"), key="lost")
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
        assert _messages_per_item(gw) == {job: 1}
        assert _drain_one(gw) == job
