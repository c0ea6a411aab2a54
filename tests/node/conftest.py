"""Fixtures for the node tests: servers the pods reach on the host end of the node's veth, the
chart installed once with its operator running as a pod, and a fencing sink for side effects."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from testenv.helm import run_helm
from testenv.kafka import KafkaBroker
from testenv.node import NodeCluster
from testenv.postgres import PostgresServer
from tests._fixtures import start_or_skip
from tests.e2e.sink import FencingSink
from tests.helm._support import CHART

#: The namespace the chart is installed into for the transport and fault tests; the operator
#: (namespaced, the chart's default) reconciles the AgentDispatch objects the tests create there.
RELEASE_NAMESPACE = "adx-e2e"
RELEASE_NAME = "adx"
#: AgentDispatch names the node tests use. The chart's operator may read only the Secrets named at
#: install time (rbac.secretNames: least privilege), so each PodDispatch's "<name>-conn" is listed.
DISPATCH_NAMES = (
    "postgres-turns",
    "kafka-turns",
    "faults",
    "hpa-postgres",
    "hpa-kafka",
    "keda-postgres",
    "keda-kafka",
    "bench-pods",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The README's block first, on a cluster with no release yet, as a user meets it: the chart's
    cluster-scoped objects (the external-metrics APIService) exist once per cluster."""
    items.sort(key=lambda item: 0 if item.nodeid.startswith("tests/node/test_readme.py") else 1)


class SlowSink(FencingSink):
    """The fencing sink as an agent endpoint that takes ``sleep_s`` (from the turn's payload)."""

    def start_on(self, host: str) -> SlowSink:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                try:
                    sleep_s = float(json.loads(body or b"{}").get("sleep_s", 0))
                except (ValueError, AttributeError):
                    sleep_s = 0.0
                time.sleep(min(sleep_s, 30.0))
                ok = sink.offer(
                    self.headers["X-Agent-Dispatch-Job-Id"],
                    int(self.headers["X-Agent-Dispatch-Fencing-Token"]),
                )
                answer = json.dumps({"accepted": ok}).encode()
                self.send_response(200 if ok else 409)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self


@pytest.fixture(scope="session")
def node_postgres(node: NodeCluster) -> Iterator[PostgresServer]:
    server = PostgresServer(host=node.host_ip, clients=str(node.network.subnet))
    try:
        yield start_or_skip("postgresql", server.start)
    finally:
        server.close()


@pytest.fixture(scope="session")
def node_kafka(node: NodeCluster) -> Iterator[KafkaBroker]:
    broker = KafkaBroker(host=node.host_ip)
    try:
        yield start_or_skip("kafka", broker.start)
    finally:
        broker.close()


@pytest.fixture(scope="session")
def node_release(
    node: NodeCluster, helm_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The chart installed (operator pod Ready); yields its namespace."""
    home = tmp_path_factory.mktemp("helm")
    run_helm(
        "install",
        RELEASE_NAME,
        str(CHART),
        "--namespace",
        RELEASE_NAMESPACE,
        "--create-namespace",
        "--wait",
        "--set",
        f"rbac.secretNames={{{','.join(f'{name}-conn' for name in DISPATCH_NAMES)}}}",
        "--timeout",
        "5m",
        helm=helm_bin,
        home=home,
        kubeconfig=node.kubeconfig,
        timeout=360,
    )
    try:
        yield RELEASE_NAMESPACE
    finally:
        node.kubectl(
            "delete",
            "agentdispatches",
            "--all",
            "-n",
            RELEASE_NAMESPACE,
            "--wait=true",
            "--timeout=120s",
            check=False,
            timeout=150,
        )
        run_helm(
            "uninstall",
            RELEASE_NAME,
            "--namespace",
            RELEASE_NAMESPACE,
            "--wait",
            helm=helm_bin,
            home=home,
            kubeconfig=node.kubeconfig,
            timeout=300,
        )


@pytest.fixture
def node_sink(node: NodeCluster) -> Iterator[SlowSink]:
    sink = SlowSink().start_on(node.host_ip)
    try:
        yield sink
    finally:
        sink.stop()
