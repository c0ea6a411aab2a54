"""kopf handlers for AgentDispatch: thin wrappers that run a reconcile pass in a thread, post its
events and write its ``.status``.

Bookkeeping lives under the project's own prefix: progress and the diff-base in
``agentdispatch.io/...`` annotations, the finalizer ``agentdispatch.io/finalizer``. Handlers are
registered in :data:`REGISTRY`, not kopf's global registry, so importing this module has no
effect on another kopf operator in the same process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, Final

import kopf
from prometheus_client import Counter, Histogram

from agent_dispatch import k8s_names
from agent_dispatch.operator import _reconcile
from agent_dispatch.operator._cluster import Cluster, ClusterError, KubeCluster

REGISTRY: Final = kopf.OperatorRegistry()
RESOURCE: Final = (k8s_names.GROUP, k8s_names.VERSION, k8s_names.PLURAL)

#: How often the timer refreshes ``.status`` (live/stale workers, depth, transport). Well below
#: the default claim TTL, so a dead worker shows as stale soon after its Lease expires.
STATUS_INTERVAL_S: Final = 10.0
#: Delay before kopf retries a pass that failed on a Kubernetes or transport error.
RETRY_DELAY_S: Final = 10.0

RECONCILES: Final = Counter(
    "agent_dispatch_operator_reconciles_total",
    "AgentDispatch reconcile passes by kind and result",
    ["kind", "result"],
)
RECONCILE_SECONDS: Final = Histogram(
    "agent_dispatch_operator_reconcile_seconds", "Duration of AgentDispatch reconcile passes", ["kind"]
)
EVENTS_POSTED: Final = Counter(
    "agent_dispatch_operator_events_total", "Kubernetes events the operator posted by reason", ["reason"]
)


def configure_settings(settings: kopf.OperatorSettings, *, scan_cluster: bool = True) -> None:
    """Decide kopf's persistence once, with the project's own names (never kopf's defaults, so
    two operators never fight over one annotation)."""
    # Watching named namespaces under a Role, kopf cannot (and need not) list namespaces or
    # CRDs cluster-wide: without this it retries those forbidden scans for about a minute.
    settings.scanning.disabled = not scan_cluster
    settings.persistence.finalizer = k8s_names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=k8s_names.ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=k8s_names.ANNOTATION_PREFIX, key=k8s_names.DIFFBASE_KEY
    )
    # INFO, so `kubectl describe` shows each change (Created, Updated, TopicCreated, ...).
    settings.posting.level = logging.INFO
    settings.execution.max_workers = 8


def _cluster(memo: Any) -> Cluster:
    cluster: Cluster | None = getattr(memo, "cluster", None)
    if cluster is None:
        cluster = KubeCluster()
        memo.cluster = cluster
    return cluster


def _kafka_ops(memo: Any) -> _reconcile.KafkaOps | None:
    ops: _reconcile.KafkaOps | None = getattr(memo, "kafka_ops", None)
    return ops


def _post(body: kopf.Body, events: list[_reconcile.Event]) -> None:
    for event in events:
        EVENTS_POSTED.labels(event.reason).inc()
        if event.type == "Warning":
            kopf.warn(body, reason=event.reason, message=event.message)
        else:
            kopf.info(body, reason=event.reason, message=event.message)


def _changed(previous: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    """Only the status keys whose value differs: an idle resource gets no writes from the timer."""
    return {key: value for key, value in status.items() if previous.get(key) != value}


async def _run_pass(kind: str, fn: Any, body: kopf.Body, memo: Any) -> _reconcile.Outcome:
    started = time.monotonic()
    try:
        outcome: _reconcile.Outcome = await asyncio.to_thread(
            fn, dict(body), _cluster(memo), _kafka_ops(memo)
        )
    except ClusterError as exc:
        RECONCILES.labels(kind, "error").inc()
        raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_S) from exc
    finally:
        RECONCILE_SECONDS.labels(kind).observe(time.monotonic() - started)
    RECONCILES.labels(
        kind, "refused" if outcome.observation.refused_reason or outcome.observation.problems else "ok"
    ).inc()
    return outcome


@kopf.on.startup(registry=REGISTRY)
def _startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    configure_settings(settings, scan_cluster=bool(getattr(memo, "scan_cluster", True)))


@kopf.on.login(registry=REGISTRY)
def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Credentials as the kubernetes client finds them (in-cluster ServiceAccount, else the
    kubeconfig); a private registry does not get kopf's default login handlers."""
    info: kopf.ConnectionInfo | None = kopf.login_via_client(**kwargs)
    return info


@kopf.on.resume(*RESOURCE, registry=REGISTRY, id="reconcile")
@kopf.on.create(*RESOURCE, registry=REGISTRY, id="reconcile")
@kopf.on.update(*RESOURCE, registry=REGISTRY, id="reconcile")
async def reconcile(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    """Create, update and resume all converge the same way; server-side apply makes a pass
    that finds nothing to do write nothing (so a restarted operator repeats no creation)."""
    outcome = await _run_pass("reconcile", _reconcile.reconcile, body, memo)
    _post(body, outcome.events)
    patch.status.update(_changed(body.get("status") or {}, outcome.status))


@kopf.timer(
    *RESOURCE,
    registry=REGISTRY,
    id="refresh-status",
    interval=STATUS_INTERVAL_S,
    initial_delay=STATUS_INTERVAL_S,
)
async def refresh_status(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    outcome = await _run_pass("refresh", _reconcile.refresh, body, memo)
    previous = body.get("status") or {}
    # Post a warning only when a condition turns bad, not on every tick while it stays bad.
    before = {c.get("type"): c.get("status") for c in previous.get("conditions") or []}
    after = {c["type"]: c for c in outcome.status.get("conditions", [])}
    for name in ("WorkersAvailable", "TransportReachable", "MetricAvailable"):
        cond = after.get(name)
        if cond is not None and cond["status"] == "False" and before.get(name) != "False":
            _post(body, [_reconcile.Event("Warning", cond["reason"], cond["message"])])
    # The autoscaler's decisions, as events on the AgentDispatch (kubectl describe shows them).
    old_scale = (previous.get("autoscaler") or {}).get("desiredReplicas")
    new_scale = (outcome.status.get("autoscaler") or {}).get("desiredReplicas")
    if new_scale is not None and old_scale is not None and new_scale != old_scale:
        message = f"the HPA scaled the workers from {old_scale} to {new_scale} replicas"
        _post(body, [_reconcile.Event("Normal", "AutoscalerScaled", message)])
    patch.status.update(_changed(previous, outcome.status))


@kopf.on.delete(*RESOURCE, registry=REGISTRY, id="cleanup")
async def cleanup(body: kopf.Body, memo: Any, **_: Any) -> None:
    try:
        changes = await asyncio.to_thread(_reconcile.cleanup, dict(body), _cluster(memo))
    except ClusterError as exc:
        raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_S) from exc
    _post(body, [_reconcile.Event("Normal", "Deleted", f"{c.kind} {c.name} deleted") for c in changes])


@kopf.on.probe(registry=REGISTRY, id="reconciles")
def _probe_reconciles(**_: Any) -> float:
    """Reported on the liveness endpoint next to kopf's own state."""
    return sum(
        sample.value
        for metric in RECONCILES.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )
