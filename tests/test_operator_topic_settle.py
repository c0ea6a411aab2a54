"""A pass that creates or grows the Kafka topic waits (bounded) for the new partitions' lag probe,
so users do not see TransportReachable=False and Ready=False right after every create or grow;
a pass that changed nothing reports a failing probe at once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_dispatch.operator import _kafka, _reconcile
from tests.test_operator_desired import FakeKafka, body, kafka_cluster, kafka_only_spec


class LeaderlessLag:
    """A lag probe that fails ``failures`` times (partitions without leaders), then answers."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self, servers: str, topic: str, group: str) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise _kafka.KafkaUnavailable("offsets not available: the topic's partitions have no leader yet")
        return 7


def _ops(kafka: FakeKafka, lag: LeaderlessLag, settle_s: float) -> _reconcile.KafkaOps:
    base = kafka.ops()
    return _reconcile.KafkaOps(
        ensure_topic=base.ensure_topic,
        describe_topic=base.describe_topic,
        consumer_lag=lag,
        settle_s=settle_s,
    )


def _reachable(outcome: _reconcile.Outcome) -> dict[str, str]:
    return next(c for c in outcome.status["conditions"] if c["type"] == "TransportReachable")


@pytest.fixture(autouse=True)
def _fast_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_reconcile, "TOPIC_SETTLE_POLL_S", 0.001)


@settings(max_examples=20, deadline=None)
@given(failures=st.integers(min_value=0, max_value=5), grow=st.booleans())
def test_a_created_or_grown_topic_is_reachable_once_its_partitions_answer(failures: int, grow: bool) -> None:
    kafka = FakeKafka(partitions=1 if grow else None)
    lag = LeaderlessLag(failures)
    outcome = _reconcile.reconcile(
        body(kafka_only_spec(partitions=3)), kafka_cluster(), _ops(kafka, lag, 30.0)
    )
    assert _reachable(outcome)["status"] == "True"
    assert outcome.status["queueDepth"] == 7
    assert lag.calls == failures + 1
    assert kafka.calls == [("grow" if grow else "create", 3)]


def test_the_wait_is_bounded_and_names_the_failure() -> None:
    lag = LeaderlessLag(failures=10**9)
    outcome = _reconcile.reconcile(body(kafka_only_spec()), kafka_cluster(), _ops(FakeKafka(), lag, 0.05))
    condition = _reachable(outcome)
    assert condition["status"] == "False"
    assert "no leader" in condition["message"]
    assert lag.calls > 1


def test_an_unchanged_topic_reports_a_failing_probe_at_once() -> None:
    kafka = FakeKafka(partitions=3)
    lag = LeaderlessLag(failures=1)
    outcome = _reconcile.reconcile(
        body(kafka_only_spec(partitions=3)), kafka_cluster(), _ops(kafka, lag, 30.0)
    )
    assert _reachable(outcome)["status"] == "False"
    assert lag.calls == 1
    assert kafka.calls == []
