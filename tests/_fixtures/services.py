"""Pytest plugin: real PostgreSQL and Kafka on loopback, started lazily by the tests that ask for them.

Session fixtures start one server per test process; function fixtures give every test its own
database and topic name, so tests never see each other's data.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator

import pytest

from testenv.kafka import KafkaBroker
from testenv.kafka_cluster import KafkaCluster
from testenv.postgres import PostgresServer
from tests._fixtures import start_or_skip


def _slug(request: pytest.FixtureRequest, limit: int) -> str:
    """Lower-case test name plus a random suffix: readable in server logs, unique across reruns."""
    name = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower()).strip("_")
    return f"{name[:limit]}_{uuid.uuid4().hex[:8]}"


# -- PostgreSQL ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        yield start_or_skip("postgresql", server.start)
    finally:
        server.close()


@pytest.fixture
def postgres_dsn(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """Superuser DSN of a fresh, empty database that is dropped (with FORCE) after the test."""
    server = postgres_server
    name = "t_" + _slug(request, 40)
    yield server.create_database(name)
    # A chaos test may leave the shared server stopped: bring it back for the tests after it.
    if not server.running:
        server.start()
    server.drop_database(name)


# -- Kafka -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    broker = KafkaBroker()
    try:
        yield start_or_skip("kafka", broker.start)
    finally:
        broker.close()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_broker: KafkaBroker) -> str:
    return kafka_broker.bootstrap


@pytest.fixture
def kafka_topic_name(kafka_broker: KafkaBroker, request: pytest.FixtureRequest) -> Iterator[str]:
    """A topic name no other test uses; the test creates the topic, teardown deletes it if it exists."""
    name = "test." + _slug(request, 80)
    yield name
    if not kafka_broker.running:
        kafka_broker.start()
    _delete_topic_quietly(kafka_broker.bootstrap, name)


@pytest.fixture(scope="session")
def kafka_cluster() -> Iterator[KafkaCluster]:
    """Three KRaft nodes, replication factor 3, ``min.insync.replicas=2`` (started on first use)."""
    cluster = KafkaCluster()
    try:
        yield start_or_skip("kafka-cluster", cluster.start)
    finally:
        cluster.close()


def _delete_topic_quietly(bootstrap: str, topic: str) -> None:
    # Best effort: keeps a long session's broker small; a missing topic or a slow broker is not a failure.
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    with contextlib.suppress(Exception):
        for future in admin.delete_topics([topic], operation_timeout=10, request_timeout=10).values():
            future.result(timeout=15)


__all__ = [
    "kafka_bootstrap",
    "kafka_broker",
    "kafka_cluster",
    "kafka_topic_name",
    "postgres_dsn",
    "postgres_server",
]
