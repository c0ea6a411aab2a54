"""``autoscaling.mode: keda`` against real KEDA: its operator and metrics adapter (built from KEDA's Go
module, testenv/keda.py) scale the worker Deployment through the ScaledObject our operator renders,
on PostgreSQL (the admission counter, by query) and on Kafka (consumer-group lag).

A backlog of slow turns (the sink sleeps ``sleep_s``) drives KEDA's HPA (``keda-hpa-<worker>``) up to
the count the metric computes, capped by ``maxReplicas`` (and on Kafka by the partitions); once the
backlog drains the workers go back to ``minReplicas``. The scale-up and scale-down latencies are
recorded (``record_property`` and the test's output), never asserted: performance is no pass mark.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testenv.kafka import KafkaBroker
from testenv.keda import APISERVICE, KEDA_NAMESPACE, KEDA_SERVICE_ACCOUNT, KedaRunner
from testenv.node import NodeCluster
from testenv.postgres import PostgresServer
from tests._fixtures import start_or_skip
from tests.node._dispatch import SCALING_CLAIM_TTL_S, PodDispatch
from tests.node._support import describe, failure
from tests.node.conftest import SlowSink

pytestmark = pytest.mark.node

MIN_REPLICAS = 1
MAX_REPLICAS = 3
TARGET_PER_REPLICA = 4
PARTITIONS = 4  # PodDispatch's; KEDA's Kafka scaler never asks for more consumers than this
#: Right after submitting, the metric must imply maxReplicas (above (MAX - 1) x TARGET = 8, with
#: margin for the turns already running); then the drain is what the test waits for, so no more.
BACKLOG = 24
SLEEP_S = 3.0


def _external_metrics_api(node: NodeCluster) -> dict[str, Any] | None:
    """Who serves external.metrics.k8s.io (the APIService's spec), or None when nobody does."""
    out = node.kubectl("get", "apiservice", APISERVICE, "-o", "json", check=False)
    return dict(json.loads(out.stdout)["spec"]) if out.returncode == 0 else None


@pytest.fixture(scope="module")
def node_keda(node: NodeCluster, node_release: str) -> Iterator[KedaRunner]:
    """KEDA running against the node while this module's tests run; stopped when they end, and
    the external metrics API given back to whoever served it before (the chart's own, when its
    metricsApi is enabled), exactly as it was."""
    before = _external_metrics_api(node)
    runner = KedaRunner(node)
    try:
        yield start_or_skip("keda", runner.start)
    finally:
        runner.stop()
    assert _external_metrics_api(node) == before


def test_keda_runs_as_its_own_service_account_with_kedas_roles(
    node: NodeCluster, node_keda: KedaRunner
) -> None:
    """The credentials KEDA's programs use are KEDA's ServiceAccount, bound by KEDA's own manifests:
    they may scale workloads and serve delegated auth, and nothing a cluster admin may."""
    assert node_keda.kubeconfig is not None

    def as_keda(*args: str) -> str:
        out = node.kubectl(*args, kubeconfig=node_keda.kubeconfig, check=False)
        return out.stdout.strip() or out.stderr.strip()

    who = json.loads(as_keda("auth", "whoami", "-o", "json"))
    assert who["status"]["userInfo"]["username"] == (
        f"system:serviceaccount:{KEDA_NAMESPACE}:{KEDA_SERVICE_ACCOUNT}"
    )
    # What KEDA's roles grant: scaling any workload, its HPAs, delegated authentication.
    assert as_keda("auth", "can-i", "patch", "deployments.apps", "--subresource=scale", "-A") == "yes"
    assert as_keda("auth", "can-i", "create", "horizontalpodautoscalers.autoscaling", "-A") == "yes"
    assert as_keda("auth", "can-i", "create", "subjectaccessreviews.authorization.k8s.io") == "yes"
    # What they do not: an admin's rights.
    assert as_keda("auth", "can-i", "create", "clusterrolebindings") == "no"
    assert as_keda("auth", "can-i", "update", "deployments.apps", "-A") == "no"
    assert as_keda("auth", "can-i", "create", "secrets", "-n", "default") == "no"


def metric_path(namespace: str, hpa: dict[str, Any]) -> str:
    """Where the HPA controller reads the HPA's one external metric: KEDA's adapter, through the
    API server's aggregation layer."""
    (metric,) = [m["external"]["metric"] for m in hpa["spec"]["metrics"]]
    selector = ",".join(f"{k}={v}" for k, v in metric["selector"]["matchLabels"].items())
    return (
        f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/{metric['name']}"
        f"?labelSelector={urllib.parse.quote(selector)}"
    )


def external_metric(node: NodeCluster, path: str) -> float:
    items = json.loads(node.kubectl("get", "--raw", path).stdout)["items"]
    return sum(_quantity(item["value"]) for item in items)


def _quantity(value: str) -> float:
    """A Kubernetes quantity as the metrics API writes it (``12``, ``12500m``)."""
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


@dataclass
class ReplicaWatch:
    """Samples, once a second, the worker Deployment's replica count and the metric KEDA serves."""

    node: NodeCluster
    namespace: str
    deployment: str
    metric_path: str
    samples: list[tuple[float, int, float | None]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> ReplicaWatch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            out = self.node.kubectl(
                "get", "deployment", self.deployment, "-n", self.namespace, "-o", "json", check=False
            )
            metric: float | None
            try:
                metric = external_metric(self.node, self.metric_path)
            except Exception:  # a failed read is a gap in the series, not a test failure
                metric = None
            if out.returncode == 0:
                replicas = int(json.loads(out.stdout)["spec"].get("replicas", 0))
                self.samples.append((time.monotonic(), replicas, metric))
            self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def first_time(self, predicate: Any, after: float = 0.0) -> float | None:
        """When a sample taken at or after ``after`` first satisfied ``predicate(replicas, metric)``."""
        return next((t for t, r, m in self.samples if t >= after and predicate(r, m)), None)

    @property
    def peak(self) -> int:
        return max((replicas for _, replicas, _ in self.samples), default=0)

    def current(self) -> int:
        return self.samples[-1][1] if self.samples else -1


def _wait(predicate: Any, timeout: float, what: str, detail: Any) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise failure(f"{what} not seen after {timeout:.0f}s", detail())


@pytest.mark.timeout(900)
def test_keda_scales_postgres_and_kafka_workers_on_backlog_and_back(
    node: NodeCluster,
    node_release: str,
    node_keda: KedaRunner,
    node_postgres: PostgresServer,
    node_kafka: KafkaBroker,
    node_sink: SlowSink,
    record_property: Any,
    tmp_path: Path,
) -> None:
    """Both triggers at once, each on its own AgentDispatch (KEDA serves them side by side, as it
    does for the ScaledObjects of a whole cluster); one run's waits overlap the other's."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            backend: pool.submit(
                _keda_run,
                backend,
                node,
                node_release,
                node_keda,
                node_postgres,
                node_kafka if backend == "kafka" else None,
                node_sink,
                tmp_path / backend,
            )
            for backend in ("postgres", "kafka")
        }
        wait(futures.values())
    failures = {backend: f.exception() for backend, f in futures.items() if f.exception()}
    for backend, future in futures.items():
        if backend not in failures:
            figures = future.result()
            for key in ("scale_up_s", "scale_down_s", "run_s"):
                record_property(f"{backend}_{key}", figures[key])
            print(f"keda scaling ({backend}): {json.dumps(figures)}")
    if failures:
        backend, error = next(iter(failures.items()))
        raise AssertionError(f"mode keda on {sorted(failures)}: {backend}: {error}") from error


def _keda_run(
    backend: str,
    node: NodeCluster,
    node_release: str,
    node_keda: KedaRunner,
    node_postgres: PostgresServer,
    kafka: KafkaBroker | None,
    node_sink: SlowSink,
    tmp_path: Path,
) -> dict[str, Any]:
    """One AgentDispatch in ``mode: keda``: up to the computed count under a backlog, back to
    ``minReplicas`` after it; returns the figures (latencies and the replica/metric series)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    dsn = node_postgres.create_database(f"keda_{backend}_{uuid.uuid4().hex[:6]}")
    name = f"keda-{backend}"
    worker = f"{name}-worker"
    dispatch = PodDispatch(
        node,
        node_release,
        name,
        backend,
        dsn=dsn,
        sink_url=node_sink.url,
        tmp_path=tmp_path,
        kafka_bootstrap=kafka.bootstrap if kafka else None,
        replicas=MIN_REPLICAS,
        claim_ttl_s=SCALING_CLAIM_TTL_S,
        extra_spec={
            "autoscaling": {
                "mode": "keda",
                "minReplicas": MIN_REPLICAS,
                "maxReplicas": MAX_REPLICAS,
                "targetDepthPerReplica": TARGET_PER_REPLICA,
                "pollingIntervalSeconds": 2,
                "cooldownSeconds": 10,
            }
        },
    )
    watch: ReplicaWatch | None = None
    started = time.monotonic()
    #: When each step ended, in seconds from the start: where a slow or failed run spent its time.
    steps: dict[str, float] = {}

    def step(name: str) -> None:
        steps[name] = round(time.monotonic() - started, 1)

    def keda_state() -> str:
        # The pods' story first and the most telling lines last: CI shows a long message's tail.
        parts = [
            describe(node, node_release),
            node.kubectl("get", "scaledobject,hpa", "-n", node_release, "-o", "yaml", check=False).stdout[
                -4000:
            ],
            "--- keda-operator\n" + node_keda.log_tail("keda-operator", 30),
            "--- keda-adapter\n" + node_keda.log_tail("keda-adapter", 15),
            f"--- {backend}: steps {steps}, (replicas, metric) every second since the submission "
            f"{[(r, m) for _, r, m in (watch.samples if watch else [])][-90:]}",
        ]
        return "\n".join(parts)

    try:
        dispatch.apply()
        dispatch.wait_ready_workers(MIN_REPLICAS)
        step("worker_ready")
        # KEDA takes the ScaledObject: it becomes Ready and KEDA's HPA for the Deployment appears.
        node.kubectl(
            "wait",
            "--for=condition=Ready",
            f"scaledobject/{worker}",
            "-n",
            node_release,
            "--timeout=120s",
            check=False,
            timeout=150,
        )
        step("scaledobject_ready")
        _wait(
            lambda: (
                node.kubectl("get", "hpa", f"keda-hpa-{worker}", "-n", node_release, check=False).returncode
                == 0
            ),
            120,
            f"KEDA's HPA keda-hpa-{worker}",
            keda_state,
        )
        step("keda_hpa")
        hpa = json.loads(
            node.kubectl("get", "hpa", f"keda-hpa-{worker}", "-n", node_release, "-o", "json").stdout
        )
        assert hpa["spec"]["scaleTargetRef"]["name"] == worker
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (MIN_REPLICAS, MAX_REPLICAS)
        assert [o["kind"] for o in hpa["metadata"]["ownerReferences"]] == ["ScaledObject"]
        path = metric_path(node_release, hpa)
        # An idle queue: the metric reads zero and the workers stay at minReplicas.
        assert external_metric(node, path) == 0, keda_state()

        dispatch.start_gateway()
        step("gateway")
        watch = ReplicaWatch(node, node_release, worker, path).start()
        submitted_at = time.monotonic()
        ids = dispatch.submit(BACKLOG, sleep_s=SLEEP_S, sessions=BACKLOG, parallel=8)
        step("submitted")
        # What KEDA serves while the backlog stands, and the count it implies.
        backlog_metric = external_metric(node, path)
        cap = min(MAX_REPLICAS, PARTITIONS) if backend == "kafka" else MAX_REPLICAS
        computed = min(cap, math.ceil(backlog_metric / TARGET_PER_REPLICA))
        assert computed == MAX_REPLICAS, (backlog_metric, keda_state())
        _wait(lambda: watch.current() >= computed, 180, f"{worker} scaled to {computed}", keda_state)
        step("scaled_up")
        scaled_up_at = watch.first_time(lambda r, m: r >= computed, submitted_at)
        dispatch.wait_ready_workers(computed, timeout=180)
        step("workers_ready")

        items = dispatch.wait_terminal(ids, timeout=600)
        step("drained")
        assert len(items) == BACKLOG
        assert dispatch.violations(ids, node_sink) == []
        _wait(lambda: watch.current() == MIN_REPLICAS, 300, f"{worker} back to {MIN_REPLICAS}", keda_state)
        step("scaled_down")
        watch.stop()

        assert watch.peak == computed, keda_state()  # never above maxReplicas (nor the partitions)
        assert scaled_up_at is not None
        # Scale-down starts when the metric says minReplicas suffice (the tail of the backlog may
        # still be running then): measured from there to the Deployment being back at minReplicas.
        enough_at = watch.first_time(
            lambda r, m: m is not None and m <= TARGET_PER_REPLICA * MIN_REPLICAS, scaled_up_at
        )
        assert enough_at is not None, keda_state()
        scaled_down_at = watch.first_time(lambda r, m: r == MIN_REPLICAS, enough_at)
        assert scaled_down_at is not None, keda_state()
        figures = {
            "backend": backend,
            "backlog_metric": backlog_metric,
            "scale_up_s": round(scaled_up_at - submitted_at, 1),
            "scale_down_s": round(scaled_down_at - enough_at, 1),
            "run_s": round(scaled_down_at - submitted_at, 1),
            "steps": steps,
            "series": [(round(t - submitted_at), r, m) for t, r, m in watch.samples],
        }
        return figures
    finally:
        if watch is not None:
            watch.stop()
        dispatch.close()
