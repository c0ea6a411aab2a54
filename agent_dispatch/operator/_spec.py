"""The AgentDispatch spec as a pydantic model: camelCase aliases, the CRD's defaults and bounds.

This model is the operator's one description of a spec's fields. Bounds shared with the process
settings (claim TTL within the RTO, partitions, depth, attempts, ...) are read from
:mod:`agent_dispatch.settings`, and ``tests/test_operator_spec.py`` checks the CRD's schema
(``crds/agentdispatch.yaml``) against this model field by field, so the three cannot disagree.
Rules across fields (renew below the TTL, a DSN for postgres, partitions grow-only) are the CRD's
CEL rules, repeated by :mod:`agent_dispatch.operator._validate`.

The API server applies the CRD defaults before the operator sees an object, but the model
applies them again so the pure functions give the same answer for a spec written by hand (unit
tests, a dry run, an object stored before a default was added).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from agent_dispatch import k8s_names
from agent_dispatch.settings import (
    CLAIM_TTL_S,
    CONCURRENCY,
    EXECUTOR_PATTERN,
    EXECUTOR_TIMEOUT_S,
    EXECUTOR_URL_PATTERN,
    KAFKA_TOPIC_LENGTH,
    KAFKA_TOPIC_PATTERN,
    MAX_ATTEMPTS,
    MAX_DEPTH,
    PARTITIONS,
    RTO_S,
    SHUTDOWN_GRACE_S,
    SWEEP_INTERVAL_S,
    Bound,
    LogLevel,
)

Backend = Literal["kafka", "postgres", "sqlite"]
AutoscalingMode = Literal["none", "hpa", "keda"]
BACKENDS: Final = get_args(Backend)
AUTOSCALING_MODES: Final = get_args(AutoscalingMode)

__all__ = ["RTO_S", "DispatchSpec", "InvalidSpec", "parse"]

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
    k8s_names.POD_UID_ENV,
)

#: Rendered object names append "-worker"; a Service name is a DNS-1035 label of at most 63.
MAX_NAME_LENGTH: Final = 63 - len("-worker")

REF_NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
REF_KEY_PATTERN: Final = r"^[-._a-zA-Z0-9]+$"
HOST_PORT_LIST_PATTERN: Final = r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}(,[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5})*$"


def _in(bound: Bound, default: int | None, **kwargs: Any) -> Any:
    """A field bounded by a range shared with the settings."""
    return Field(default, ge=bound.low, le=bound.high, **kwargs)


def _count(low: int, high: int, default: int | None, **kwargs: Any) -> Any:
    return Field(default, ge=low, le=high, **kwargs)


class _Part(BaseModel):
    # strict: "60" for an integer or 1 for a string is a mistake to report, not to coerce.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, frozen=True, strict=True, extra="ignore"
    )


Text253 = Annotated[str, Field(min_length=1, max_length=253)]


class SecretRef(_Part):
    name: Annotated[Text253, Field(pattern=REF_NAME_PATTERN)]
    key: Annotated[Text253, Field(pattern=REF_KEY_PATTERN)]

    def as_env_source(self) -> dict[str, Any]:
        return {"secretKeyRef": {"name": self.name, "key": self.key}}


class Executor(_Part):
    name: str = Field("noop", min_length=1, max_length=512, pattern=EXECUTOR_PATTERN)
    url: str | None = Field(None, max_length=2048, pattern=EXECUTOR_URL_PATTERN)
    timeout_s: int | None = _in(EXECUTOR_TIMEOUT_S, None, alias="timeoutSeconds")


#: A plain default, not a factory, so the JSON schema (and the CRD check) sees it; pydantic copies it.
DEFAULT_RESOURCES: Final = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}


class Worker(_Part):
    image: str = Field(min_length=1, max_length=1024)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    replicas: int = _count(0, 1000, 1)
    concurrency: int = _in(CONCURRENCY, 4)
    executor: Executor = Field(default_factory=lambda: Executor.model_validate({}))
    # Kubernetes EnvVar objects, passed through as written (only their names are checked).
    env: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    resources: dict[str, Any] = Field(DEFAULT_RESOURCES)
    metrics_port: int = _count(1, 65535, 9464)
    log_level: LogLevel = "INFO"
    service_account_name: str | None = Field(None, max_length=253)
    shutdown_grace_s: int = _in(SHUTDOWN_GRACE_S, 30, alias="shutdownGraceSeconds")
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    pod_labels: dict[str, str] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    priority_class_name: str | None = Field(None, max_length=253)

    @field_validator("env")
    @classmethod
    def _named(cls, env: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for item in env:
            name = item.get("name")
            if not isinstance(name, str) or not 1 <= len(name) <= 256:
                raise ValueError("every entry needs a name of 1 to 256 characters")
        return env


class Autoscaling(_Part):
    mode: AutoscalingMode = "none"
    min_replicas: int = _count(0, 1000, 1)
    max_replicas: int = _count(1, 1000, 10)
    target_depth_per_replica: int = _count(1, 1_000_000, 10)
    polling_interval_s: int = _count(1, 3600, 30, alias="pollingIntervalSeconds")
    cooldown_s: int = _count(0, 86400, 300, alias="cooldownSeconds")
    postgresql_query: str | None = Field(None, max_length=4096)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


class Kafka(_Part):
    bootstrap_servers: str | None = Field(None, min_length=1, max_length=2048, pattern=HOST_PORT_LIST_PATTERN)
    bootstrap_servers_secret: SecretRef | None = Field(None, alias="bootstrapServersSecretRef")
    topic: str = Field(
        "agent_turns",
        min_length=KAFKA_TOPIC_LENGTH.low,
        max_length=KAFKA_TOPIC_LENGTH.high,
        pattern=KAFKA_TOPIC_PATTERN,
    )
    consumer_group: str = Field("agent-dispatch", min_length=1, max_length=255)
    replication_factor: int | None = _count(1, 32, None)


class Postgres(_Part):
    dsn_secret: SecretRef | None = Field(None, alias="dsnSecretRef")


class DispatchSpec(_Part):
    backend: Backend = "postgres"
    partitions: int = _in(PARTITIONS, 6)
    max_depth: int = _in(MAX_DEPTH, 100_000)
    claim_ttl_s: int = _in(CLAIM_TTL_S, 120, alias="claimTtlSeconds")
    # Its ceiling is the claim TTL: a rule across fields (CEL in the CRD, _validate here).
    renew_interval_s: int = Field(30, ge=1, alias="renewIntervalSeconds")
    sweep_interval_s: int | None = _in(SWEEP_INTERVAL_S, None, alias="sweepIntervalSeconds")
    max_attempts: int | None = _in(MAX_ATTEMPTS, None)
    signing_key_secret: SecretRef | None = Field(None, alias="signingKeySecretRef")
    postgres: Postgres | None = None
    kafka: Kafka | None = None
    worker: Worker
    autoscaling: Autoscaling = Field(default_factory=lambda: Autoscaling.model_validate({}))

    @property
    def dsn_secret(self) -> SecretRef | None:
        return self.postgres.dsn_secret if self.postgres is not None else None


class InvalidSpec(ValueError):
    """The spec's fields do not fit the model; ``errors`` are pydantic's, located by alias."""

    def __init__(self, error: ValidationError) -> None:
        super().__init__(str(error))
        self.error = error


def parse(spec: Mapping[str, Any]) -> DispatchSpec:
    """Typed view of ``spec`` with the CRD defaults filled in; :class:`InvalidSpec` when a field
    is malformed. Rules across fields are :func:`agent_dispatch.operator._validate.validate`'s."""
    try:
        return DispatchSpec.model_validate(dict(spec))
    except ValidationError as exc:
        raise InvalidSpec(exc) from None
