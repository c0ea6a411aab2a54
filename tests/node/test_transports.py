"""Worker pods on the real node, one AgentDispatch per transport: turns go in through the gateway
(PostgreSQL, Kafka) or the CLI inside the pod (SQLite, whose database lives in the pod), and every
accepted turn ends succeeded exactly once, its one accepted side effect carrying its final token."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from testenv.kafka import KafkaBroker
from testenv.node import NodeCluster
from testenv.postgres import PostgresServer
from tests.node._dispatch import PodDispatch
from tests.node._support import describe, pods
from tests.node.conftest import SlowSink

pytestmark = pytest.mark.node


@pytest.mark.parametrize("backend", ["postgres", "kafka"])
def test_worker_pods_run_gateway_turns_exactly_once(
    backend: str,
    node: NodeCluster,
    node_release: str,
    node_postgres: PostgresServer,
    node_sink: SlowSink,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    kafka: KafkaBroker | None = request.getfixturevalue("node_kafka") if backend == "kafka" else None
    dsn = node_postgres.create_database(f"pods_{backend}_{uuid.uuid4().hex[:6]}")
    dispatch = PodDispatch(
        node,
        node_release,
        f"{backend}-turns",
        backend,
        dsn=dsn,
        sink_url=node_sink.url,
        tmp_path=tmp_path,
        kafka_bootstrap=kafka.bootstrap if kafka else None,
    )
    try:
        dispatch.apply()
        workers = dispatch.wait_ready_workers(2)
        # The chart's worker ServiceAccount (release "adx": <fullname>-worker), though the spec names none.
        assert {p["spec"]["serviceAccountName"] for p in workers} == {"adx-agent-dispatch-worker"}
        dispatch.start_gateway()
        ids = dispatch.submit(60, sleep_s=0.05)
        items = dispatch.wait_terminal(ids, timeout=240)
        assert dispatch.violations(ids, node_sink) == []
        # The turns ran in the pods: each commit's owner is one of the worker pods.
        pod_names = {p["metadata"]["name"] for p in dispatch.worker_pods()}
        owners = {
            (record.owner or "").split("/")[0]
            for item in items.values()
            for record in dispatch.store.outcomes(item.id)
            if record.event == "commit"
        }
        assert owners and owners <= pod_names, (owners, pod_names)

        # kubectl logs and exec work on a worker pod; the doctor inside it answers in JSON.
        name = workers[0]["metadata"]["name"]
        logs = node.kubectl("logs", "-n", node_release, name).stdout
        assert '"msg": "worker started"' in logs, logs[-2000:]
        doctor = node.kubectl(
            "exec", "-n", node_release, name, "--", "agent-dispatch", "doctor", "--json", check=False
        )
        report = json.loads(doctor.stdout)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert {check["name"] for check in report["checks"]} >= {"settings", "dispatch_lease_recovery"}
        assert node.host_ip not in doctor.stdout and "/var/lib" not in doctor.stdout  # redacted
    finally:
        dispatch.close()


def test_sqlite_worker_pod_runs_turns_submitted_inside_it(node: NodeCluster, node_release: str) -> None:
    name = "sqlite-turns"
    resource = {
        "apiVersion": "agentdispatch.io/v1alpha1",
        "kind": "AgentDispatch",
        "metadata": {"name": name, "namespace": node_release},
        "spec": {
            "backend": "sqlite",
            "worker": {
                "image": node.images.app_ref if node.images else "",
                "replicas": 1,
                "executor": {"name": "noop"},
            },
        },
    }
    node.kubectl("apply", "-f", "-", input=json.dumps(resource))
    try:
        selector = f"agent-dispatch.io/instance={name}"
        node.kubectl(
            "wait", "--for=create", f"deployment/{name}-worker", "-n", node_release, "--timeout=120s"
        )
        node.kubectl(
            "rollout",
            "status",
            f"deployment/{name}-worker",
            "-n",
            node_release,
            "--timeout=180s",
            timeout=200,
        )
        (pod,) = [p for p in pods(node, node_release, selector) if not p["metadata"].get("deletionTimestamp")]
        pod_name = pod["metadata"]["name"]
        handles = []
        for index in range(5):
            out = node.kubectl(
                "exec",
                "-n",
                node_release,
                pod_name,
                "--",
                "agent-dispatch",
                "submit",
                "--session",
                f"s{index % 2}",
                "--payload",
                json.dumps({"n": index}),
                "--wait",
                "--timeout",
                "60",
                check=False,
                timeout=120,
            )
            assert out.returncode == 0, f"{out.stdout}{out.stderr}\n{describe(node, node_release)}"
            handles.append(json.loads(out.stdout))  # --wait prints one document: the final status
        assert [h["state"] for h in handles] == ["succeeded"] * 5, handles
        # Read-only root filesystem, non-root: the database is in the pod's emptyDir.
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    finally:
        node.kubectl(
            "delete",
            "agentdispatch",
            name,
            "-n",
            node_release,
            "--wait=true",
            "--timeout=120s",
            check=False,
            timeout=150,
        )
