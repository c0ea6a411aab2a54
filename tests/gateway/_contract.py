"""What the idempotency-contract tests share: the three backends, a gateway on each, and a worker
that finishes one turn (the only thing that gives room back under the bound). The fixtures are
registered for the package by ``tests/gateway/conftest.py``."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch.models import Outcome
from agent_dispatch.settings import ENV_NAMES, Settings
from tests.gateway._harness import Running, gateway_settings

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("kafka", id="kafka", marks=[pytest.mark.kafka, pytest.mark.postgres]),
]
TENANT = "tenant-a"
WAIT_S = 60.0


@pytest.fixture(params=BACKENDS)
def contract_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def contract_settings(contract_backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Gateway settings on ``contract_backend``: SQLite, PostgreSQL, or Kafka with its WorkItems
    in PostgreSQL (keyword arguments override)."""
    backend = contract_backend

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


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that configures a CLI process like ``settings`` (direct mode)."""
    env: dict[str, str] = {}
    for name in ("backend_choice", "data_dir", "signing_key", "max_depth", "state_db_uri"):
        value = getattr(settings, name)
        if value is not None:
            value = value.get_secret_value() if hasattr(value, "get_secret_value") else value
            env[ENV_NAMES[name]] = str(getattr(value, "value", value))
    if settings.kafka_bootstrap_servers:
        env[ENV_NAMES["kafka_bootstrap_servers"]] = settings.kafka_bootstrap_servers
        env[ENV_NAMES["kafka_topic"]] = settings.kafka_topic
        env[ENV_NAMES["kafka_group"]] = settings.kafka_group
    return env


def body(name: str) -> dict[str, Any]:
    return {"kind": "t", "payload": {"name": name}}


def finish_one(gw: Running) -> str:
    """A worker takes one delivery, runs its WorkItem to ``succeeded`` and acknowledges it: one
    slot of room under the bound (accepted, unfinished turns are what the bound counts)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        got = gw.transport.claim("finisher", max_items=1, wait_s=1.0)
        if got:
            delivery = got[0]
            lease = gw.store.claim("finisher", work_item_id=delivery.work_item_id)
            assert lease is not None, f"{delivery.work_item_id} was not claimable"
            gw.store.commit(gw.store.mark_running(lease), Outcome.SUCCEEDED)
            gw.transport.ack(delivery.receipt)
            return delivery.work_item_id
        assert time.monotonic() < deadline, "no delivery to finish"


def until_accepted(gw: Running, name: str, key: str) -> tuple[dict[str, Any], Counter[int]]:
    """Retry with the same key (as a client would after 429) until it is accepted."""
    seen: Counter[int] = Counter()
    deadline = time.monotonic() + WAIT_S
    while True:
        reply = gw.submit(body(name), key=key)
        seen[reply.status] += 1
        if reply.status == 202:
            return reply.json(), seen
        assert reply.status == 429, reply.body
        assert time.monotonic() < deadline, f"{key} still refused: {seen}"
        time.sleep(0.1)


def messages_per_item(gw: Running) -> Counter[str]:
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


def job_ids(gw: Running) -> list[str]:
    return [job["job_id"] for job in gw.call("GET", "/api/graph/jobs?limit=100").json()["jobs"]]
