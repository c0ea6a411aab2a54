"""The AgentDispatch spec as typed values, with the CRD's defaults.

The API server applies the CRD defaults before the operator sees an object, but the operator
applies them again here so the pure functions give the same answer for a spec written by hand
(unit tests, a dry run, an object stored before a default was added).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from agent_dispatch import k8s_names

BACKENDS: Final = ("kafka", "postgres", "sqlite")
AUTOSCALING_MODES: Final = ("none", "hpa", "keda")

#: The recovery-time objective (the same number as settings.RTO_S, kept as a literal in the CRD).
RTO_S: Final = 300

#: Environment the operator derives from the spec; a user's spec.worker.env must not set these
#: (the CRD rejects it too). The list is also the CRD's CEL list; a unit test keeps them equal.
RESERVED_ENV: Final = (
    "TASK_QUEUE_BACKEND",
    "STATE_DB_URI",
    "KAFKA_BOOTSTRAP_SERVERS",
    "AGENT_TURNS_PARTITIONS",
    "AGENT_DISPATCH_MAX_DEPTH",
    "AGENT_DISPATCH_CLAIM_TTL_S",
    "AGENT_DISPATCH_RENEW_INTERVAL_S",
    "AGENT_DISPATCH_SWEEP_INTERVAL_S",
    "AGENT_DISPATCH_MAX_ATTEMPTS",
    "AGENT_DISPATCH_SIGNING_KEY",
    "AGENT_DISPATCH_KAFKA_TOPIC",
    "AGENT_DISPATCH_KAFKA_GROUP",
    "AGENT_DISPATCH_METRICS_PORT",
    "AGENT_DISPATCH_LOG_LEVEL",
    "AGENT_DISPATCH_LOG_FORMAT",
    "AGENT_DISPATCH_DATA_DIR",
    "AGENT_DISPATCH_CONCURRENCY",
    "AGENT_DISPATCH_EXECUTOR",
    "AGENT_DISPATCH_EXECUTOR_URL",
    "AGENT_DISPATCH_EXECUTOR_TIMEOUT_S",
    "AGENT_DISPATCH_SHUTDOWN_GRACE_S",
    k8s_names.INSTANCE_ENV,
    k8s_names.NAMESPACE_ENV,
    k8s_names.WORKER_ID_ENV,
)

#: Rendered object names append "-worker"; a Service name is a DNS-1035 label of at most 63.
MAX_NAME_LENGTH: Final = 63 - len("-worker")


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str

    def as_env_source(self) -> dict[str, Any]:
        return {"secretKeyRef": {"name": self.name, "key": self.key}}


@dataclass(frozen=True)
class Executor:
    name: str = "noop"
    url: str | None = None
    timeout_s: int | None = None


@dataclass(frozen=True)
class Worker:
    image: str = ""
    image_pull_policy: str = "IfNotPresent"
    replicas: int = 1
    concurrency: int = 4
    executor: Executor = field(default_factory=Executor)
    env: list[dict[str, Any]] = field(default_factory=list)
    resources: dict[str, Any] = field(
        default_factory=lambda: {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        }
    )
    metrics_port: int = 9464
    log_level: str = "INFO"
    service_account_name: str | None = None
    shutdown_grace_s: int = 30
    pod_annotations: dict[str, str] = field(default_factory=dict)
    pod_labels: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)
    priority_class_name: str | None = None


@dataclass(frozen=True)
class Autoscaling:
    mode: str = "none"
    min_replicas: int = 1
    max_replicas: int = 10
    target_depth_per_replica: int = 10
    polling_interval_s: int = 30
    cooldown_s: int = 300
    postgresql_query: str | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True)
class Kafka:
    bootstrap_servers: str | None = None
    bootstrap_servers_secret: SecretRef | None = None
    topic: str = "agent_turns"
    consumer_group: str = "agent-dispatch"
    replication_factor: int | None = None


@dataclass(frozen=True)
class DispatchSpec:
    backend: str = "postgres"
    partitions: int = 6
    max_depth: int = 100_000
    claim_ttl_s: int = 120
    renew_interval_s: int = 30
    sweep_interval_s: int | None = None
    max_attempts: int | None = None
    signing_key_secret: SecretRef | None = None
    dsn_secret: SecretRef | None = None
    kafka: Kafka | None = None
    worker: Worker = field(default_factory=Worker)
    autoscaling: Autoscaling = field(default_factory=Autoscaling)


def _ref(raw: Any) -> SecretRef | None:
    if not isinstance(raw, Mapping):
        return None
    return SecretRef(name=str(raw.get("name", "")), key=str(raw.get("key", "")))


def _int(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    # A bool is an int to Python but never a valid count here; keep it visible to validation.
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _opt_int(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _map(raw: Any) -> dict[str, Any]:
    return dict(raw) if isinstance(raw, Mapping) else {}


def parse(spec: Mapping[str, Any]) -> DispatchSpec:
    """Typed view of ``spec`` with the CRD defaults filled in. Never raises: what cannot be read
    falls back to a default here and is reported by :func:`agent_dispatch.operator._validate.validate`."""
    worker_raw = _map(spec.get("worker"))
    executor_raw = _map(worker_raw.get("executor"))
    defaults = Worker()
    worker = Worker(
        image=str(worker_raw.get("image", "")),
        image_pull_policy=str(worker_raw.get("imagePullPolicy", defaults.image_pull_policy)),
        replicas=_int(worker_raw, "replicas", defaults.replicas),
        concurrency=_int(worker_raw, "concurrency", defaults.concurrency),
        executor=Executor(
            name=str(executor_raw.get("name", "noop")),
            url=executor_raw.get("url") or None,
            timeout_s=_opt_int(executor_raw, "timeoutSeconds"),
        ),
        env=[dict(item) for item in worker_raw.get("env", []) or [] if isinstance(item, Mapping)],
        resources=_map(worker_raw["resources"]) if "resources" in worker_raw else defaults.resources,
        metrics_port=_int(worker_raw, "metricsPort", defaults.metrics_port),
        log_level=str(worker_raw.get("logLevel", defaults.log_level)),
        service_account_name=worker_raw.get("serviceAccountName") or None,
        shutdown_grace_s=_int(worker_raw, "shutdownGraceSeconds", defaults.shutdown_grace_s),
        pod_annotations={str(k): str(v) for k, v in _map(worker_raw.get("podAnnotations")).items()},
        pod_labels={str(k): str(v) for k, v in _map(worker_raw.get("podLabels")).items()},
        node_selector={str(k): str(v) for k, v in _map(worker_raw.get("nodeSelector")).items()},
        tolerations=[dict(t) for t in worker_raw.get("tolerations", []) or [] if isinstance(t, Mapping)],
        affinity=_map(worker_raw.get("affinity")),
        priority_class_name=worker_raw.get("priorityClassName") or None,
    )
    auto_raw = _map(spec.get("autoscaling"))
    auto_defaults = Autoscaling()
    autoscaling = Autoscaling(
        mode=str(auto_raw.get("mode", auto_defaults.mode)),
        min_replicas=_int(auto_raw, "minReplicas", auto_defaults.min_replicas),
        max_replicas=_int(auto_raw, "maxReplicas", auto_defaults.max_replicas),
        target_depth_per_replica=_int(
            auto_raw, "targetDepthPerReplica", auto_defaults.target_depth_per_replica
        ),
        polling_interval_s=_int(auto_raw, "pollingIntervalSeconds", auto_defaults.polling_interval_s),
        cooldown_s=_int(auto_raw, "cooldownSeconds", auto_defaults.cooldown_s),
        postgresql_query=auto_raw.get("postgresqlQuery") or None,
    )
    kafka: Kafka | None = None
    if "kafka" in spec:
        kafka_raw = _map(spec.get("kafka"))
        kafka = Kafka(
            bootstrap_servers=kafka_raw.get("bootstrapServers") or None,
            bootstrap_servers_secret=_ref(kafka_raw.get("bootstrapServersSecretRef")),
            topic=str(kafka_raw.get("topic", "agent_turns")),
            consumer_group=str(kafka_raw.get("consumerGroup", "agent-dispatch")),
            replication_factor=_opt_int(kafka_raw, "replicationFactor"),
        )
    return DispatchSpec(
        backend=str(spec.get("backend", "postgres")),
        partitions=_int(spec, "partitions", 6),
        max_depth=_int(spec, "maxDepth", 100_000),
        claim_ttl_s=_int(spec, "claimTtlSeconds", 120),
        renew_interval_s=_int(spec, "renewIntervalSeconds", 30),
        sweep_interval_s=_opt_int(spec, "sweepIntervalSeconds"),
        max_attempts=_opt_int(spec, "maxAttempts"),
        signing_key_secret=_ref(spec.get("signingKeySecretRef")),
        dsn_secret=_ref(_map(spec.get("postgres")).get("dsnSecretRef")),
        kafka=kafka,
        worker=worker,
        autoscaling=autoscaling,
    )
