"""Faults under load on every transport: nothing lost, nothing committed twice (issue 10).

Per transport: a gateway process, three worker processes (the recording executor, whose side
effect goes to the fencing sink) and four HTTP clients; faults at seeded random times (SIGKILL a
worker and start a replacement, SIGSTOP one past the claim TTL then SIGCONT, restart the gateway,
restart PostgreSQL, restart the Kafka broker). Then ``ChaosRun.verify`` checks the invariants.
Reproduce a run with its logged seed: ``pytest tests/chaos -m chaos --chaos-seed=SEED``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from testenv.kafka_cluster import KafkaCluster
from tests.chaos.harness import ChaosRun, Services, env_for_chaos, write_report
from tests.chaos.kafka_support import REPLICATED
from tests.e2e.harness import Backend, backend_env

pytestmark = pytest.mark.chaos

TRANSPORTS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("kafka", id="kafka", marks=[pytest.mark.kafka, pytest.mark.postgres]),
    # Three brokers, replication factor 3, min.insync.replicas=2: leader kills, two brokers lost,
    # every broker restarted, a broker paused (tests/chaos/kafka_support.py).
    pytest.param(REPLICATED, id=REPLICATED, marks=[pytest.mark.kafka, pytest.mark.postgres]),
]


def replicated_backend(cluster: KafkaCluster, tmp_path: Path, request: pytest.FixtureRequest) -> Backend:
    """The Kafka transport on the three-node cluster (its WorkItems in PostgreSQL, as on one broker).

    The topic is created by the transport itself (``ensure_ready``) with no replication factor
    given, so it gets the cluster's: the run checks that every partition has three replicas.
    """
    env = backend_env("postgres", tmp_path, request, **env_for_chaos()).env
    env.update(
        {
            "TASK_QUEUE_BACKEND": "kafka",
            "KAFKA_BOOTSTRAP_SERVERS": cluster.bootstrap,
            "AGENT_DISPATCH_KAFKA_TOPIC": f"chaos.replicated.{uuid.uuid4().hex[:8]}",
            "AGENT_DISPATCH_KAFKA_GROUP": f"chaos-{uuid.uuid4().hex[:8]}",
            "AGENT_TURNS_PARTITIONS": "4",
        }
    )
    return Backend(REPLICATED, env)


def durable_commits(dsn: str) -> None:
    """The test server runs with ``synchronous_commit = off`` (fast, and fine while it never
    crashes); a crash-like restart would then lose commits the clients were told about, as it
    would on any server configured so. Production keeps the default, ``on``: so does this database."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        name = conn.execute("SELECT current_database()").fetchone()
        assert name is not None
        conn.execute(sql.SQL("ALTER DATABASE {} SET synchronous_commit = on").format(sql.Identifier(name[0])))


@pytest.fixture
def chaos_run(
    request: pytest.FixtureRequest, tmp_path: Path, chaos_seed: int, chaos_duration: float
) -> Iterator[ChaosRun]:
    name = request.param
    if name == REPLICATED:
        backend = replicated_backend(request.getfixturevalue("kafka_cluster"), tmp_path, request)
    else:
        backend = backend_env(name, tmp_path, request, **env_for_chaos())
    services = Services(
        postgres=request.getfixturevalue("postgres_server") if name != "sqlite" else None,
        kafka=request.getfixturevalue("kafka_broker" if name == "kafka" else "kafka_cluster")
        if name.startswith("kafka")
        else None,
    )
    if "STATE_DB_URI" in backend.env:
        durable_commits(backend.env["STATE_DB_URI"])
    run = ChaosRun(name, backend, tmp_path, seed=chaos_seed, duration_s=chaos_duration, services=services)
    try:
        yield run
    finally:
        run.close()
        # Leave the shared servers up for the tests after this one.
        for server in (services.postgres, services.kafka):
            if server is not None and not server.running:
                server.start()


@pytest.mark.parametrize("chaos_run", TRANSPORTS, indirect=True)
def test_faults_under_load_lose_nothing_and_commit_once(
    chaos_run: ChaosRun, chaos_report: Path | None
) -> None:
    chaos_run.run()
    chaos_run.finish()
    report = chaos_run.verify()
    write_report(chaos_report, report)
    summary = {k: v for k, v in report.items() if k != "fault_log"}
    print(f"[chaos {chaos_run.name}] report {json.dumps(summary)}")
    assert report["turns_accepted"] > 0, report
    assert not report["violations"], (
        f"seed {chaos_run.seed}: invariant violations on {chaos_run.name}:\n"
        + "\n".join(report["violations"])
        + f"\nfault log: {json.dumps(report['fault_log'])}"
    )
    # Every fault type this transport has was injected at least once.
    from tests.chaos.harness import FAULTS_BY_TRANSPORT

    assert set(report["faults"]) == set(FAULTS_BY_TRANSPORT[chaos_run.name]), report["faults"]
