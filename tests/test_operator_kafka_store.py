"""A Kafka AgentDispatch's WorkItem store is migrated by the reconcile pass even when the Kafka step
fails (a brand-new topic's first lag probe): otherwise nothing migrated it later, the status timer
reported the transport reachable, and every gateway answered 503 SchemaOutdated (seen on the node)."""

from __future__ import annotations

from typing import Any

import pytest

from agent_dispatch.operator import _kafka, _reconcile
from tests.test_operator_desired import FakeCluster, FakeKafka, body, kafka_spec


def _failing_lag(servers: str, topic: str, group: str) -> int:
    raise _kafka.KafkaUnavailable("offsets not available: the topic's partitions have no leader yet")


@pytest.fixture
def store_steps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every store step the pass runs (its ``mutate``), with no database behind it."""
    calls: list[bool] = []

    def step(spec: Any, cluster: Any, namespace: str, *, mutate: bool) -> _reconcile.Transport:
        calls.append(mutate)
        return _reconcile.Transport(ok=True, message="PostgreSQL reachable")

    monkeypatch.setattr(_reconcile, "_postgres_step", step)
    return calls


def _cluster() -> FakeCluster:
    return FakeCluster({("kafka", "servers"): "127.0.0.1:9092", ("pg", "dsn"): "postgresql://x"})


def test_a_failed_kafka_probe_still_migrates_the_store_and_reports_kafka(store_steps: list[bool]) -> None:
    ops = FakeKafka().ops()
    failing = _reconcile.KafkaOps(
        ensure_topic=ops.ensure_topic,
        describe_topic=ops.describe_topic,
        consumer_lag=_failing_lag,
        settle_s=0.3,  # the topic was just created: the probe is retried, then the failure reported
    )
    outcome = _reconcile.reconcile(body(kafka_spec()), _cluster(), failing)
    assert store_steps == [True]
    conditions = {c["type"]: c for c in outcome.status["conditions"]}
    assert conditions["TransportReachable"]["status"] == "False"
    assert "no leader" in conditions["TransportReachable"]["message"]


def test_a_refused_partition_decrease_touches_nothing(store_steps: list[bool]) -> None:
    outcome = _reconcile.reconcile(body(kafka_spec(partitions=3)), _cluster(), FakeKafka(partitions=6).ops())
    assert store_steps == []
    assert outcome.observation.refused_reason == "PartitionDecreaseRefused"
