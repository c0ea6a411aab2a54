"""One reconcile pass, and one status refresh, for an AgentDispatch: blocking, handler-free.

:func:`reconcile` makes the cluster match the spec (topic, schema, Deployment, Service,
autoscaler) and returns the new ``.status`` plus the events to post; :func:`refresh` only
observes (workers, depth, transport) and never writes a child. The kopf handlers run them in a
worker thread and do nothing else, so both are tested directly against a real API server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from agent_dispatch import doctor, k8s_names
from agent_dispatch.operator import _desired, _hooks, _kafka, _status
from agent_dispatch.operator._cluster import Cluster, ClusterError
from agent_dispatch.operator._spec import DispatchSpec, parse
from agent_dispatch.operator._validate import partition_decrease, validate

log = logging.getLogger("agent_dispatch.operator")

EventType = Literal["Normal", "Warning"]

POSTGRES_CONNECT_TIMEOUT_S: Final = 5

#: How long a pass that created or grew the topic waits for its lag probe to work: a new partition
#: answers offset requests only once it has a leader, usually within a few seconds. Without the
#: wait, every create or grow showed TransportReachable=False (and Ready=False) until the status
#: timer's next probe.
TOPIC_SETTLE_S: Final = 10.0
TOPIC_SETTLE_POLL_S: Final = 0.2


@dataclass(frozen=True)
class Event:
    type: EventType
    reason: str
    message: str


@dataclass(frozen=True)
class Change:
    kind: str
    name: str
    action: Literal["created", "updated", "deleted"]


@dataclass
class Outcome:
    """The result of one pass: the full ``.status`` to write, and what changed and why."""

    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    observation: _status.Observation = field(default_factory=_status.Observation)


@dataclass
class Transport:
    """What the transport step found: reachability, partitions in force, depth, refusal."""

    ok: bool | None = None
    message: str = ""
    partitions: int | None = None
    depth: int | None = None
    refused: str | None = None
    events: list[Event] = field(default_factory=list)
    checks: list[doctor.Check] = field(default_factory=list)


#: Topic operations, injectable so a test can run the reconcile logic without a broker.
@dataclass(frozen=True)
class KafkaOps:
    ensure_topic: Callable[[str, str, int, int | None], _kafka.TopicResult] = _kafka.ensure_topic
    describe_topic: Callable[[str, str], int | None] = _kafka.describe_topic
    consumer_lag: Callable[[str, str, str], int | None] = _kafka.consumer_lag
    settle_s: float = TOPIC_SETTLE_S
    """How long the lag probe is retried after this pass created or grew the topic."""


def _meta(body: Mapping[str, Any]) -> tuple[str, str, int | None]:
    meta = body.get("metadata") or {}
    generation = meta.get("generation")
    return (
        str(meta["name"]),
        str(meta.get("namespace", "")),
        generation if isinstance(generation, int) else None,
    )


def _bootstrap(spec: DispatchSpec, cluster: Cluster, namespace: str) -> str | None:
    kafka = spec.kafka
    if kafka is None:
        return None
    if kafka.bootstrap_servers is not None:
        return kafka.bootstrap_servers
    ref = kafka.bootstrap_servers_secret
    return cluster.read_secret(namespace, ref.name, ref.key) if ref is not None else None


def _kafka_servers(spec: DispatchSpec, cluster: Cluster, namespace: str) -> str | Transport:
    """The bootstrap servers, or the failed step that says why there are none."""
    assert spec.kafka is not None
    try:
        servers = _bootstrap(spec, cluster, namespace)
    except ClusterError as exc:
        return Transport(ok=False, message=f"cannot read the bootstrap servers Secret: {exc}")
    if not servers:
        ref = spec.kafka.bootstrap_servers_secret
        where = f"Secret {ref.name} key {ref.key}" if ref else "spec.kafka"
        return Transport(ok=False, message=f"no bootstrap servers in {where}")
    return servers


def _consumer_lag(kafka: KafkaOps, servers: str, topic: str, group: str, *, settle: bool) -> int | None:
    """The group's lag; right after a create or grow, retried until the new partitions have
    leaders (bounded by ``kafka.settle_s``), then the last failure is reported."""
    deadline = time.monotonic() + (kafka.settle_s if settle else 0.0)
    while True:
        try:
            return kafka.consumer_lag(servers, topic, group)
        except _kafka.KafkaUnavailable:
            if time.monotonic() >= deadline:
                raise
            time.sleep(TOPIC_SETTLE_POLL_S)


def _kafka_step(
    spec: DispatchSpec, servers: str, recorded: int | None, kafka: KafkaOps, *, mutate: bool
) -> Transport:
    assert spec.kafka is not None
    result = Transport()
    topic = spec.kafka.topic
    refused = partition_decrease(spec.partitions, recorded)
    changed = False  # this pass created or grew the topic
    try:
        if refused is not None:
            # Refused before any call that could change the topic: only look.
            current = kafka.describe_topic(servers, topic)
            result.partitions = max(current or 0, recorded or 0)
            result.refused = str(refused)
        elif mutate:
            topic_result = kafka.ensure_topic(servers, topic, spec.partitions, spec.kafka.replication_factor)
            result.partitions = topic_result.partitions
            if topic_result.action == "refused":
                result.refused = f"spec.partitions: {topic_result.message}"
            elif topic_result.action == "created":
                changed = True
                result.events.append(Event("Normal", "TopicCreated", topic_result.message))
            elif topic_result.action == "grown":
                changed = True
                result.events.append(Event("Normal", "PartitionsGrown", topic_result.message))
        else:
            current = kafka.describe_topic(servers, topic)
            result.partitions = current
            if current is not None and spec.partitions < current:
                result.refused = str(partition_decrease(spec.partitions, current))
        result.depth = _consumer_lag(kafka, servers, topic, spec.kafka.consumer_group, settle=changed)
    except _kafka.KafkaUnavailable as exc:
        return replace(result, ok=False, message=doctor.redact(str(exc)))
    result.ok = True
    result.message = f"Kafka reachable; topic {topic} has {result.partitions} partitions"
    return result


def _postgres_step(spec: DispatchSpec, cluster: Cluster, namespace: str, *, mutate: bool) -> Transport:
    ref = spec.dsn_secret
    if ref is None:
        return Transport(ok=None, message="no PostgreSQL store configured")
    try:
        dsn = cluster.read_secret(namespace, ref.name, ref.key)
    except ClusterError as exc:
        return Transport(ok=False, message=f"cannot read Secret {ref.name}: {exc}")
    if not dsn:
        return Transport(ok=False, message=f"Secret {ref.name} has no key {ref.key}")
    try:
        import psycopg

        with psycopg.connect(dsn, connect_timeout=POSTGRES_CONNECT_TIMEOUT_S) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:  # any driver error means "unreachable"
        return Transport(ok=False, message=f"PostgreSQL unreachable: {_postgres_failure(exc)}")
    result = Transport(ok=True, message="PostgreSQL reachable")
    if mutate:
        try:
            migrated = _hooks.run_migrations(dsn)
        except Exception as exc:  # a failed migration is reported, never a crash of the operator
            result.ok = False
            result.message = f"migrations failed: {_postgres_failure(exc)}"
            return result
        result.checks.append(
            doctor.Check("schema_migrations", "ok" if migrated.ran else "warn", migrated.detail)
        )
        if migrated.ran:
            result.events.append(Event("Normal", "SchemaMigrated", migrated.detail))
    if spec.backend == "postgres":
        try:
            depth = _hooks.queue_depth(dsn)
            result.depth = int(depth.value) if depth.ran and depth.value is not None else None
        except Exception as exc:  # depth is informative; its failure does not make the store unreachable
            result.checks.append(
                doctor.Check("queue_depth", "warn", doctor.redact(f"{type(exc).__name__}: {exc}"))
            )
    return result


_PG_FAILURES: Final = (
    ("password authentication failed", "authentication failed"),
    ("does not exist", "database or role does not exist"),
    ("connection refused", "connection refused"),
    ("timeout", "connection timed out"),
    ("could not translate host name", "host name not resolvable"),
    ("no pg_hba.conf entry", "rejected by pg_hba.conf"),
)


def _spec_changed(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """Did our apply change the object? ``generation`` moves only with the spec, whereas the
    resourceVersion also moves when a controller writes status between our read and our apply."""
    old, new = before.get("metadata") or {}, after.get("metadata") or {}
    if old.get("generation") and new.get("generation"):
        return bool(old["generation"] != new["generation"])
    return bool(old.get("resourceVersion") != new.get("resourceVersion"))


def _postgres_failure(exc: BaseException) -> str:
    """A category, never the driver's text: libpq messages quote addresses, users and database
    names, which must not reach .status or events."""
    text = str(exc).lower()
    for needle, category in _PG_FAILURES:
        if needle in text:
            return f"{type(exc).__name__}: {category}"
    return type(exc).__name__


def _transport(
    spec: DispatchSpec,
    cluster: Cluster,
    namespace: str,
    recorded: int | None,
    kafka: KafkaOps,
    *,
    mutate: bool,
) -> Transport:
    if spec.backend == "kafka" and spec.kafka is not None:
        servers = _kafka_servers(spec, cluster, namespace)
        result = (
            servers
            if isinstance(servers, Transport)
            else _kafka_step(spec, servers, recorded, kafka, mutate=mutate)
        )
        # The WorkItem store's schema does not depend on Kafka: it is migrated even when the Kafka
        # step failed (a brand-new topic's first lag probe often does, before its partitions have
        # leaders). Skipped, nothing would migrate it later: the status timer only observes, so the
        # next probe reports the transport reachable over a store every gateway refuses (503).
        if result.refused is None and spec.dsn_secret is not None:
            store = _postgres_step(spec, cluster, namespace, mutate=mutate)
            result.events += store.events
            result.checks += store.checks
            if result.ok and store.ok is False:
                return replace(result, ok=False, message=store.message)
        return result
    result = _postgres_step(spec, cluster, namespace, mutate=mutate)
    refused = partition_decrease(spec.partitions, recorded)
    if refused is not None:
        result.refused = str(refused)
        result.partitions = recorded
    else:
        result.partitions = spec.partitions
    if spec.backend == "sqlite":
        result.ok, result.message = None, "sqlite is local to each worker pod; nothing to probe"
    return result


def _apply_children(
    body: Mapping[str, Any], cluster: Cluster, spec: DispatchSpec
) -> tuple[list[Change], str | None]:
    """Server-side apply the rendered objects; delete autoscalers of the other mode. Returns the
    changes and an autoscaler error (KEDA not installed, say), which does not stop the rest."""
    rendered = _desired.desired(body, _hooks.depth_query(), _hooks.default_worker_service_account())
    namespace = str(body["metadata"]["namespace"])
    changes: list[Change] = []
    autoscaler_error: str | None = None
    for obj in rendered.objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            before = cluster.get(obj["apiVersion"], kind, namespace, name)
            after = cluster.apply(obj)
        except ClusterError as exc:
            if obj is rendered.autoscaler and exc.status == 404:
                autoscaler_error = f"{kind} is not served by this cluster (is its operator installed?)"
                continue
            raise
        if before is None:
            changes.append(Change(kind, name, "created"))
        elif _spec_changed(before, after):
            changes.append(Change(kind, name, "updated"))
    for api_version, kind, name in rendered.absent:
        try:
            if cluster.delete(api_version, kind, namespace, name):
                changes.append(Change(kind, name, "deleted"))
        except ClusterError as exc:
            if exc.status != 404:  # 404: the kind itself is not served (no KEDA): nothing to delete
                raise
    return changes, autoscaler_error


def _workers(cluster: Cluster, namespace: str, instance: str) -> _status.Workers:
    leases = cluster.list(
        k8s_names.LEASE_API_VERSION, "Lease", namespace, k8s_names.worker_lease_selector(instance)
    )
    return _status.fold_leases(leases)


def _desired_workers(
    cluster: Cluster, namespace: str, instance: str, spec: DispatchSpec
) -> tuple[int | None, int]:
    deployment = cluster.get("apps/v1", "Deployment", namespace, _desired.worker_name(instance))
    available = int(((deployment or {}).get("status") or {}).get("availableReplicas") or 0)
    if not spec.autoscaling.enabled:
        return spec.worker.replicas, available
    replicas = ((deployment or {}).get("spec") or {}).get("replicas")
    return (replicas if isinstance(replicas, int) else None), available


def _hpa_state(
    cluster: Cluster, namespace: str, instance: str, spec: DispatchSpec, depth: int | None
) -> tuple[dict[str, Any], list[_status.Condition]]:
    """Mode hpa: the HPA's state for ``.status.autoscaler``, the MetricAvailable condition, and
    ``queueDepthTime`` (the metrics API refuses a depth older than three refreshes)."""
    if spec.autoscaling.mode != "hpa":
        return {}, []
    hpa = cluster.get(
        _desired.HPA_API_VERSION, "HorizontalPodAutoscaler", namespace, _desired.worker_name(instance)
    )
    extra: dict[str, Any] = {"autoscaler": _status.autoscaler_status("hpa", hpa)}
    if depth is not None:
        extra["queueDepthTime"] = k8s_names.rfc3339(_status.now_utc())
    return extra, [_status.metric_condition(depth, hpa)]


def _finish(
    body: Mapping[str, Any],
    spec: DispatchSpec | None,
    obs: _status.Observation,
    transport: Transport,
    *,
    available: int | None,
    reconciled: bool,
    hpa: tuple[dict[str, Any], list[_status.Condition]] = ({}, []),
) -> dict[str, Any]:
    previous = body.get("status") or {}
    _, _, generation = _meta(body)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": _status.merge_conditions(
            previous.get("conditions"), [*_status.conditions(obs), *hpa[1]], generation
        ),
        "workers": _status.workers_status(obs, available),
        "queueDepth": transport.depth,
        **hpa[0],
    }
    # A refresh leaves the time of the last reconcile alone, so an idle resource's status stays
    # byte-identical between refreshes and the timer writes nothing.
    last = k8s_names.rfc3339(_status.now_utc()) if reconciled else previous.get("lastReconcileTime")
    if last is not None:
        status["lastReconcileTime"] = last
    # The partitions high-water mark never goes down, whatever a later spec says.
    known = [p for p in (transport.partitions, previous.get("partitions")) if isinstance(p, int)]
    if known:
        status["partitions"] = max(known)
    if spec is not None:
        probes = [_status.observation_probe(obs), lambda _s: list(transport.checks)]
        status["doctor"] = _status.doctor_report(spec, probes)
    return status


def _pass(body: Mapping[str, Any], cluster: Cluster, kafka: KafkaOps | None, *, mutate: bool) -> Outcome:
    instance, namespace, _ = _meta(body)
    raw_spec = body.get("spec") or {}
    problems = validate(raw_spec, instance)
    workers = _workers(cluster, namespace, instance)
    if problems:
        obs = _status.Observation(problems=tuple(str(p) for p in problems), workers=workers)
        event = Event(
            "Warning", _status.REASON_INVALID_SPEC, "; ".join(str(p) for p in problems) + "; nothing changed"
        )
        return Outcome(
            _finish(body, None, obs, Transport(), available=None, reconciled=mutate), [event], [], obs
        )
    spec = parse(raw_spec)
    recorded = (body.get("status") or {}).get("partitions")
    transport = _transport(
        spec,
        cluster,
        namespace,
        recorded if isinstance(recorded, int) else None,
        kafka or KafkaOps(),
        mutate=mutate,
    )
    events = list(transport.events)
    changes: list[Change] = []
    autoscaler_error: str | None = None
    reconcile_error: str | None = None
    if transport.refused is not None:
        if mutate:
            events.append(Event("Warning", _status.REASON_PARTITION_DECREASE, transport.refused))
    elif mutate:
        try:
            changes, autoscaler_error = _apply_children(body, cluster, spec)
        except ClusterError as exc:
            reconcile_error = str(exc)
            events.append(Event("Warning", _status.REASON_RECONCILE_FAILED, reconcile_error))
        for change in changes:
            events.append(
                Event("Normal", change.action.capitalize(), f"{change.kind} {change.name} {change.action}")
            )
        if autoscaler_error is not None:
            events.append(Event("Warning", _status.REASON_AUTOSCALER_UNAVAILABLE, autoscaler_error))
    desired_workers, available = _desired_workers(cluster, namespace, instance, spec)
    obs = _status.Observation(
        refused_reason=_status.REASON_PARTITION_DECREASE if transport.refused else None,
        refused_message=transport.refused or "",
        transport_ok=transport.ok,
        transport_message=transport.message,
        workers=workers,
        desired_workers=desired_workers,
        autoscaler_error=autoscaler_error,
        reconcile_error=reconcile_error,
    )
    hpa = _hpa_state(cluster, namespace, instance, spec, transport.depth)
    return Outcome(
        _finish(body, spec, obs, transport, available=available, reconciled=mutate, hpa=hpa),
        events,
        changes,
        obs,
    )


def reconcile(body: Mapping[str, Any], cluster: Cluster, kafka: KafkaOps | None = None) -> Outcome:
    """Make the cluster match ``body`` (an AgentDispatch); an invalid spec or a partition
    decrease changes nothing and is reported in the returned status and events."""
    return _pass(body, cluster, kafka, mutate=True)


def refresh(body: Mapping[str, Any], cluster: Cluster, kafka: KafkaOps | None = None) -> Outcome:
    """Observe only: workers from Leases, queue depth, transport, partitions; no child is written."""
    return _pass(body, cluster, kafka, mutate=False)


def cleanup(body: Mapping[str, Any], cluster: Cluster) -> list[Change]:
    """Delete the rendered children (the garbage collector would too, through the owner
    references; deleting here makes it prompt and independent of it). The Kafka topic and the
    database are kept: they hold turns and history, and deleting data is an operator's decision."""
    instance, namespace, _ = _meta(body)
    name = _desired.worker_name(instance)
    changes: list[Change] = []
    for api_version, kind in (
        (_desired.KEDA_API_VERSION, "ScaledObject"),
        (_desired.HPA_API_VERSION, "HorizontalPodAutoscaler"),
        ("v1", "Service"),
        ("apps/v1", "Deployment"),
    ):
        try:
            if cluster.delete(api_version, kind, namespace, name):
                changes.append(Change(kind, name, "deleted"))
        except ClusterError as exc:
            if exc.status != 404:
                raise
    return changes
