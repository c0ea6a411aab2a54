"""``autoscaling.mode: hpa`` on the real node: the chart's own external-metrics API serves
``agent_dispatch_queue_depth`` through the aggregator, and the real HPA controller
(kube-controller-manager, 2 s sync, no downscale stabilisation) scales the worker Deployment.

A backlog of slow turns (the sink sleeps ``sleep_s``) raises the replicas to the computed count,
never above ``maxReplicas`` (nor the partition count on Kafka), and they return to ``minReplicas``
once it drains; a spec change meanwhile leaves the HPA's replicas alone; with the metrics API
down the HPA holds its count and the AgentDispatch says so; callers who are not the front proxy,
or who may not read the metric, are refused.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testenv.kafka import KafkaBroker
from testenv.node import NodeCluster
from testenv.postgres import PostgresServer
from tests.node._dispatch import SCALING_CLAIM_TTL_S, PodDispatch
from tests.node._support import describe, failure
from tests.node.conftest import RELEASE_NAME, SlowSink

pytestmark = pytest.mark.node

#: The chart's full name for release "adx" is "adx-agent-dispatch".
METRICS_API = f"{RELEASE_NAME}-agent-dispatch-metrics-api"
METRIC_PATH = "/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/agent_dispatch_queue_depth"
TARGET = 5  # turns per replica
#: Set to a PNG path to plot replicas and depth over time from the run (docs/operator.md).
PLOT_ENV = "AGENT_DISPATCH_AUTOSCALING_PLOT"


@dataclass
class Timeline:
    """Samples of (seconds since start, Deployment replicas, HPA desired, depth) once a second."""

    started: float = field(default_factory=time.monotonic)
    samples: list[tuple[float, int | None, int | None, int | None]] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)

    def mark(self, what: str) -> float:
        self.events[what] = round(time.monotonic() - self.started, 1)
        return self.events[what]


def _get(node: NodeCluster, kind: str, namespace: str, name: str) -> dict[str, Any]:
    out = node.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def _sample(
    node: NodeCluster, dispatch: PodDispatch, timeline: Timeline
) -> tuple[int | None, dict[str, Any]]:
    """One kubectl call for the Deployment, the HPA and the AgentDispatch (a call costs a process)."""
    ns, name = dispatch.namespace, dispatch.name
    out = node.kubectl(
        "get",
        f"deployment/{name}-worker",
        f"hpa/{name}-worker",
        f"agentdispatch/{name}",
        "-n",
        ns,
        "-o",
        "json",
        "--ignore-not-found",
        check=False,
    )
    found: dict[str, dict[str, Any]] = {}
    if out.stdout.strip():
        body = json.loads(out.stdout)
        for item in body.get("items", [body]):
            found[item.get("kind", "")] = item
    deployment = found.get("Deployment", {})
    hpa = found.get("HorizontalPodAutoscaler", {})
    ad = found.get("AgentDispatch", {})
    replicas = (deployment.get("spec") or {}).get("replicas")
    desired = (hpa.get("status") or {}).get("desiredReplicas")
    depth = (ad.get("status") or {}).get("queueDepth")
    timeline.samples.append((round(time.monotonic() - timeline.started, 1), replicas, desired, depth))
    return replicas, ad


def _watch(
    node: NodeCluster,
    dispatch: PodDispatch,
    timeline: Timeline,
    until: Any,
    timeout: float,
    what: str,
    *,
    ceiling: int,
) -> dict[str, Any]:
    """Sample once a second until ``until(replicas, agentdispatch)``; replicas never above ``ceiling``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replicas, ad = _sample(node, dispatch, timeline)
        assert replicas is None or replicas <= ceiling, f"replicas {replicas} above {ceiling}"
        if until(replicas, ad):
            return ad
        time.sleep(1)
    raise failure(
        f"timed out after {timeout}s waiting for {what}; last samples {timeline.samples[-5:]}",
        describe(node, dispatch.namespace),
        node.kubectl("describe", "hpa", "-n", dispatch.namespace, check=False).stdout[-3000:],
    )


def _condition(ad: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in (ad.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def _hpa_dispatch(
    node: NodeCluster,
    namespace: str,
    backend: str,
    postgres: PostgresServer,
    sink: SlowSink,
    tmp_path: Path,
    *,
    max_replicas: int,
    kafka: KafkaBroker | None = None,
) -> PodDispatch:
    dsn = postgres.create_database(f"hpa_{backend}_{uuid.uuid4().hex[:6]}")
    return PodDispatch(
        node,
        namespace,
        f"hpa-{backend}",  # listed in conftest.DISPATCH_NAMES (the operator reads its Secret)
        backend,
        dsn=dsn,
        sink_url=sink.url,
        tmp_path=tmp_path,
        kafka_bootstrap=kafka.bootstrap if kafka else None,
        claim_ttl_s=SCALING_CLAIM_TTL_S,
        extra_spec={
            "autoscaling": {
                "mode": "hpa",
                "minReplicas": 1,
                "maxReplicas": max_replicas,
                "targetDepthPerReplica": TARGET,
            }
        },
    )


def _scale_run(
    node: NodeCluster,
    dispatch: PodDispatch,
    *,
    max_replicas: int,
    turns: int,
    sleep_s: float,
) -> Timeline:
    """Backlog up, spec change during scaling, drain, back to minReplicas; returns the timeline."""
    ns, name = dispatch.namespace, dispatch.name
    timeline = Timeline()
    dispatch.apply()
    dispatch.wait_ready_workers(1)
    dispatch.start_gateway()
    # The operator publishes a fresh depth and the HPA reads it before any backlog.
    _watch(
        node,
        dispatch,
        timeline,
        lambda r, ad: r == 1 and _condition(ad, "MetricAvailable").get("status") == "True",
        180,
        "the HPA reading the depth at minReplicas",
        ceiling=max_replicas,
    )
    # The first turn through a fresh gateway can find the transport still warming up (Kafka: the
    # producer's metadata); it is retried with the same key until accepted, before the clock starts.
    warm_deadline = time.monotonic() + 120
    while True:
        try:
            warm = dispatch.submit(1)
            break
        except AssertionError:
            if time.monotonic() > warm_deadline:
                raise
    if dispatch.refusals:
        first = dispatch.refusals[0][0]
        print(
            f"\n{name}: the gateway refused {len(dispatch.refusals)} times for "
            f"{time.monotonic() - first:.1f}s before its first acceptance: "
            f"{sorted({why for _t, why in dispatch.refusals})}"
        )
    timeline = Timeline()
    timeline.mark("submit")
    ids = dispatch.submit(turns, sleep_s=sleep_s, sessions=turns, parallel=8)
    timeline.mark("submitted")
    # The computed count: the backlog is far above max_replicas * TARGET, so the HPA must ask for
    # exactly maxReplicas (ceil(depth / target) capped), never more.
    assert math.ceil(turns / TARGET) > max_replicas
    _watch(
        node, dispatch, timeline, lambda r, _ad: (r or 0) > 1, 120, "the first scale-up", ceiling=max_replicas
    )
    timeline.mark("first_scale_up")
    _watch(
        node, dispatch, timeline, lambda r, _ad: r == max_replicas, 180, "maxReplicas", ceiling=max_replicas
    )
    timeline.mark("at_max")

    # A spec change while the HPA owns the count: the operator re-renders the Deployment but
    # never writes replicas (it does not even own the field). The spec asks for 0, a count the HPA
    # never sets (minReplicas 1) and would not undo (a target at 0 disables it): a 0 in any later
    # sample is the operator's, however far the drain has gone meanwhile.
    before = _get(node, "agentdispatch", ns, name)["metadata"]["generation"]
    patched_at = timeline.mark("spec_change")
    node.kubectl(
        "patch",
        "agentdispatch",
        name,
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"worker": {"replicas": 0}}}),
    )
    _watch(
        node,
        dispatch,
        timeline,
        lambda _r, ad: (ad.get("status") or {}).get("observedGeneration", 0) > before,
        60,
        "the spec change reconciled",
        ceiling=max_replicas,
    )
    for _ in range(3):
        replicas, _ad = _sample(node, dispatch, timeline)
        assert replicas, f"the spec change moved replicas to {replicas}"
        time.sleep(1)
    deployment = json.loads(
        node.kubectl(
            "get", "deployment", f"{name}-worker", "-n", ns, "-o", "json", "--show-managed-fields"
        ).stdout
    )
    owners = [
        m["manager"]
        for m in deployment["metadata"]["managedFields"]
        if "f:replicas" in json.dumps(m.get("fieldsV1", {}).get("f:spec", {}))
    ]
    assert "agent-dispatch-operator" not in owners, owners

    # The drain, sampled all along: the HPA scales down as the depth falls, before the last turn ends.
    _watch(
        node,
        dispatch,
        timeline,
        lambda _r, ad: (ad.get("status") or {}).get("queueDepth") == 0,
        600,
        "the depth falling to 0",
        ceiling=max_replicas,
    )
    timeline.mark("depth_zero")
    _watch(
        node,
        dispatch,
        timeline,
        lambda r, _ad: r == 1,
        180,
        "minReplicas after the drain",
        ceiling=max_replicas,
    )
    timeline.mark("back_to_min")
    zeros = [t for t, r, _d, _q in timeline.samples if t >= patched_at and r == 0]
    assert not zeros, f"the operator wrote the spec's 0 replicas (samples at {zeros})"
    ids = warm + ids
    dispatch.wait_terminal(ids, timeout=600)
    assert dispatch.violations(ids, dispatch_sink(dispatch)) == []
    return timeline


_SINKS: dict[str, SlowSink] = {}


def dispatch_sink(dispatch: PodDispatch) -> SlowSink:
    return _SINKS[dispatch.name]


def _report(timeline: Timeline, backend: str, max_replicas: int) -> None:
    ev = timeline.events
    figures = {
        "backend": backend,
        "maxReplicas": max_replicas,
        "scale_up_first_s": round(ev["first_scale_up"] - ev["submit"], 1),
        "scale_up_to_max_s": round(ev["at_max"] - ev["submit"], 1),
        # From the first depth reading of 0 to minReplicas (the HPA may be there already).
        "scale_down_to_min_s": round(ev["back_to_min"] - ev["depth_zero"], 1),
        # The first replica removed after the peak, in seconds after submitting.
        "first_scale_down_s": next(
            (
                t
                for t, r, _d, _q in timeline.samples
                if t > ev["at_max"] and r is not None and r < max_replicas
            ),
            None,
        ),
        "events": ev,
    }
    print(f"\nautoscaling {backend}: {json.dumps(figures)}")
    plot = os.environ.get(PLOT_ENV)
    if plot:
        from tests.node._plot import plot_timeline

        target = Path(plot)
        if "{backend}" in plot:
            target = Path(plot.format(backend=backend))
        plot_timeline(timeline.samples, timeline.events, target, f"mode hpa on {backend}: replicas and depth")
        target.with_suffix(".json").write_text(json.dumps({**figures, "samples": timeline.samples}))


#: The HPA's ceiling per backend: on Kafka the partition count (4, the CRD refuses more).
MAX_REPLICAS = {"postgres": 3, "kafka": 4}
#: Turns of SLEEP_S each: enough that the depth stays above maxReplicas x TARGET until the HPA has
#: read it (one status refresh, 10 s, plus one HPA sync) and through the spec-change check at
#: maxReplicas, and no more, since the drain is most of the test's time.
TURNS = 80
SLEEP_S = 2.0


def test_hpa_scales_postgres_and_kafka_workers_on_queue_depth(
    node: NodeCluster,
    node_release: str,
    node_postgres: PostgresServer,
    node_kafka: KafkaBroker,
    node_sink: SlowSink,
    tmp_path: Path,
) -> None:
    """Both backends at once, each its own AgentDispatch, database and gateway (they share the
    node, the HPA controller and the metrics API as tenants of one cluster do); the waits of one
    run overlap the other's instead of adding to them."""
    for backend in MAX_REPLICAS:
        (tmp_path / backend).mkdir()
    dispatches = {
        backend: _hpa_dispatch(
            node,
            node_release,
            backend,
            node_postgres,
            node_sink,
            tmp_path / backend,
            max_replicas=MAX_REPLICAS[backend],
            kafka=node_kafka if backend == "kafka" else None,
        )
        for backend in MAX_REPLICAS
    }
    # On Kafka, maxReplicas = partitions: the ceiling is checked at every sample.
    assert dispatches["kafka"].spec["partitions"] == MAX_REPLICAS["kafka"]
    for dispatch in dispatches.values():
        _SINKS[dispatch.name] = node_sink
    try:
        with ThreadPoolExecutor(max_workers=len(dispatches)) as pool:
            futures = {
                backend: pool.submit(
                    _scale_run,
                    node,
                    dispatch,
                    max_replicas=MAX_REPLICAS[backend],
                    turns=TURNS,
                    sleep_s=SLEEP_S,
                )
                for backend, dispatch in dispatches.items()
            }
            wait(futures.values())
        failures = {backend: f.exception() for backend, f in futures.items() if f.exception()}
        for backend, future in futures.items():
            if backend not in failures:
                _report(future.result(), backend, MAX_REPLICAS[backend])
        if failures:
            backend, error = next(iter(failures.items()))
            raise AssertionError(f"mode hpa on {sorted(failures)}: {backend}: {error}") from error
    finally:
        with ThreadPoolExecutor(max_workers=len(dispatches)) as pool:
            list(pool.map(PodDispatch.close, dispatches.values()))


def _scale_metrics_api(node: NodeCluster, namespace: str, replicas: int) -> None:
    node.kubectl("scale", "deployment", METRICS_API, "-n", namespace, f"--replicas={replicas}")
    if replicas:
        node.kubectl(
            "rollout", "status", f"deployment/{METRICS_API}", "-n", namespace, "--timeout=120s", timeout=150
        )


def test_with_the_metrics_api_down_the_hpa_holds_and_the_agentdispatch_says_so(
    node: NodeCluster,
    node_release: str,
    node_postgres: PostgresServer,
    node_sink: SlowSink,
    tmp_path: Path,
) -> None:
    ns = node_release
    dispatch = _hpa_dispatch(node, ns, "postgres", node_postgres, node_sink, tmp_path, max_replicas=3)
    timeline = Timeline()
    try:
        dispatch.apply()
        dispatch.wait_ready_workers(1)
        dispatch.start_gateway()
        # Enough to hold maxReplicas (depth above 2 x TARGET) until the metrics API is down.
        ids = dispatch.submit(50, sleep_s=SLEEP_S, sessions=50, parallel=8)
        _watch(node, dispatch, timeline, lambda r, _ad: r == 3, 180, "maxReplicas", ceiling=3)
        _scale_metrics_api(node, ns, 0)
        try:
            ad = _watch(
                node,
                dispatch,
                timeline,
                lambda _r, ad: _condition(ad, "MetricAvailable").get("status") == "False",
                90,
                "MetricAvailable=False",
                ceiling=3,
            )
            cond = _condition(ad, "MetricAvailable")
            assert cond["reason"] == "MetricUnavailable" and "holds its replica count" in cond["message"]
            # The backlog drains with the metric gone: a working HPA would scale down, this one holds.
            dispatch.wait_terminal(ids, timeout=600)
            # Several HPA syncs (testenv's controller-manager syncs every 2 s) with depth 0.
            held_from = time.monotonic()
            while time.monotonic() - held_from < 15:
                replicas, _ad = _sample(node, dispatch, timeline)
                assert replicas == 3, f"the HPA changed replicas to {replicas} without its metric"
                time.sleep(2)
            events = node.kubectl(
                "get",
                "events",
                "-n",
                ns,
                "--field-selector",
                f"involvedObject.name={dispatch.name}",
                "-o",
                "json",
            ).stdout
            assert "MetricUnavailable" in events
        finally:
            _scale_metrics_api(node, ns, 1)
        # With the metric back (a fresh depth of 0), the HPA resumes and scales down.
        ad = _watch(
            node, dispatch, timeline, lambda r, _ad: r == 1, 180, "minReplicas after recovery", ceiling=3
        )
        ad = _watch(
            node,
            dispatch,
            timeline,
            lambda _r, ad: _condition(ad, "MetricAvailable").get("status") == "True",
            60,
            "MetricAvailable=True",
            ceiling=3,
        )
        auto = ad["status"]["autoscaler"]
        assert auto["mode"] == "hpa" and auto["desiredReplicas"] == 1 and "lastScaleTime" in auto
        described = node.kubectl("describe", "agentdispatch", dispatch.name, "-n", ns).stdout
        assert "AutoscalerScaled" in described and "Desired Replicas" in described
    finally:
        dispatch.close()


def test_only_the_front_proxy_with_an_allowed_user_reads_the_metric(
    node: NodeCluster,
    node_release: str,
    node_postgres: PostgresServer,
    node_sink: SlowSink,
    tmp_path: Path,
) -> None:
    ns = node_release
    dispatch = _hpa_dispatch(node, ns, "postgres", node_postgres, node_sink, tmp_path, max_replicas=2)
    try:
        dispatch.apply()
        selector = f"labelSelector=agent-dispatch.io/instance={dispatch.name}"
        path = METRIC_PATH.format(ns=ns)

        def admin_reads() -> dict[str, Any] | None:
            out = node.kubectl("get", "--raw", f"{path}?{selector}", check=False)
            return json.loads(out.stdout) if out.returncode == 0 else None

        deadline = time.monotonic() + 120
        body = admin_reads()
        while (body is None or not body["items"]) and time.monotonic() < deadline:
            time.sleep(2)
            body = admin_reads()
        assert body is not None and body["kind"] == "ExternalMetricValueList", body
        [item] = body["items"]
        assert item["metricLabels"]["agent-dispatch.io/instance"] == dispatch.name
        assert int(item["value"]) == 0

        # Discovery, as the HPA controller and kubectl read it through the aggregator.
        resources = json.loads(node.kubectl("get", "--raw", "/apis/external.metrics.k8s.io/v1beta1").stdout)
        assert [r["name"] for r in resources["resources"]] == ["agent_dispatch_queue_depth"]
        # Another namespace holds no instance: the empty list; an unknown metric: 404.
        other = json.loads(node.kubectl("get", "--raw", METRIC_PATH.format(ns="default")).stdout)
        assert other["items"] == []
        unknown = node.kubectl(
            "get",
            "--raw",
            f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/no_such_metric",
            check=False,
        )
        assert unknown.returncode != 0 and "NotFound" in unknown.stderr + unknown.stdout

        # A ServiceAccount without rights: the aggregator authenticates it, our SAR denies it.
        node.kubectl("create", "serviceaccount", "no-metrics", "-n", ns, check=False)
        denied = node.kubectl(
            "get", "--raw", path, f"--as=system:serviceaccount:{ns}:no-metrics", check=False
        )
        assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr

        # Straight to the Service from inside a pod, without the front-proxy certificate: 401,
        # whatever user the request headers claim.
        service_ip = _get(node, "service", ns, METRICS_API)["spec"]["clusterIP"]
        pod = json.loads(
            node.kubectl(
                "get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=operator", "-o", "json"
            ).stdout
        )["items"][0]["metadata"]["name"]
        probe = (
            "import ssl,urllib.request,urllib.error\n"
            "c=ssl.create_default_context();c.check_hostname=False;c.verify_mode=ssl.CERT_NONE\n"
            f"r=urllib.request.Request('https://{service_ip}{path}',headers={{'X-Remote-User':'system:admin',"
            "'X-Remote-Group':'system:masters'})\n"
            "try:\n print(urllib.request.urlopen(r,context=c,timeout=10).status)\n"
            "except urllib.error.HTTPError as e:\n print(e.code)\n"
        )
        out = node.kubectl("exec", "-n", ns, pod, "--", "python3", "-c", probe, timeout=60)
        assert out.stdout.strip() == "401", out.stdout + out.stderr
    finally:
        dispatch.close()
