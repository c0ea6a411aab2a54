"""Operator-side validation of an AgentDispatch spec: defence in depth behind the CRD's CEL rules.

The API server already rejects these specs, but an object can reach the operator without those
rules (the CRD installed by an older chart, a rule disabled by an administrator, an object
stored before a rule existed). An invalid spec sets ``ConfigValid=False`` and changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from agent_dispatch.operator._spec import (
    AUTOSCALING_MODES,
    BACKENDS,
    MAX_NAME_LENGTH,
    RESERVED_ENV,
    RTO_S,
    parse,
)

_DNS_LABEL: Final = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_SECRET_NAME: Final = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_SECRET_KEY: Final = re.compile(r"^[-._a-zA-Z0-9]+$")
_TOPIC: Final = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_HOST_PORT: Final = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$")
_EXECUTOR: Final = re.compile(r"^(noop|sleep|http|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")
_URL: Final = re.compile(r"^https?://\S+$")

_INT_FIELDS: Final = (
    "partitions",
    "maxDepth",
    "claimTtlSeconds",
    "renewIntervalSeconds",
    "sweepIntervalSeconds",
    "maxAttempts",
)


@dataclass(frozen=True)
class Problem:
    """One reason a spec is invalid: the field path and what is wrong with it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _check_ref(raw: Any, path: str, problems: list[Problem]) -> None:
    if raw is None:
        return
    if not isinstance(raw, Mapping):
        problems.append(Problem(path, "must be an object with name and key"))
        return
    if not isinstance(raw.get("name"), str) or not _SECRET_NAME.match(raw["name"]):
        problems.append(Problem(f"{path}.name", "must name a Secret (a DNS subdomain)"))
    if not isinstance(raw.get("key"), str) or not _SECRET_KEY.match(raw["key"]):
        problems.append(Problem(f"{path}.key", "must be a Secret key"))


def validate(spec: Mapping[str, Any], name: str | None = None) -> list[Problem]:
    """Every problem with ``spec`` (empty when valid). ``name`` is the AgentDispatch's name."""
    problems: list[Problem] = []
    if name is not None and (len(name) > MAX_NAME_LENGTH or not _DNS_LABEL.match(name)):
        problems.append(
            Problem(
                "metadata.name",
                f"must be a DNS label of at most {MAX_NAME_LENGTH} characters starting with a letter "
                "(rendered objects are named <name>-worker)",
            )
        )
    for key in _INT_FIELDS:
        value = spec.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            problems.append(Problem(f"spec.{key}", "must be an integer"))
    parsed = parse(spec)

    if parsed.backend not in BACKENDS:
        problems.append(Problem("spec.backend", f"must be one of {', '.join(BACKENDS)}"))
    if not 1 <= parsed.partitions <= 10_000:
        problems.append(Problem("spec.partitions", "must be from 1 to 10000"))
    if parsed.max_depth < 1:
        problems.append(Problem("spec.maxDepth", "must be at least 1"))
    if parsed.max_depth > 1_000_000_000:
        problems.append(Problem("spec.maxDepth", "must be at most 1000000000"))
    if parsed.claim_ttl_s < 1:
        problems.append(Problem("spec.claimTtlSeconds", "must be at least 1"))
    if parsed.claim_ttl_s > RTO_S:
        problems.append(
            Problem("spec.claimTtlSeconds", f"must be at most {RTO_S} (the recovery-time objective)")
        )
    if parsed.renew_interval_s < 1:
        problems.append(Problem("spec.renewIntervalSeconds", "must be at least 1"))
    if parsed.renew_interval_s >= parsed.claim_ttl_s:
        problems.append(Problem("spec.renewIntervalSeconds", "must be below spec.claimTtlSeconds"))
    if parsed.sweep_interval_s is not None and not 1 <= parsed.sweep_interval_s <= RTO_S:
        problems.append(Problem("spec.sweepIntervalSeconds", f"must be from 1 to {RTO_S}"))
    if parsed.max_attempts is not None and not 1 <= parsed.max_attempts <= 100:
        problems.append(Problem("spec.maxAttempts", "must be from 1 to 100"))

    _check_ref(spec.get("signingKeySecretRef"), "spec.signingKeySecretRef", problems)
    postgres = spec.get("postgres")
    if isinstance(postgres, Mapping):
        _check_ref(postgres.get("dsnSecretRef"), "spec.postgres.dsnSecretRef", problems)
    if parsed.backend == "postgres" and parsed.dsn_secret is None:
        problems.append(Problem("spec.postgres.dsnSecretRef", "is required when spec.backend is postgres"))

    kafka_raw = spec.get("kafka")
    if isinstance(kafka_raw, Mapping):
        _check_ref(
            kafka_raw.get("bootstrapServersSecretRef"), "spec.kafka.bootstrapServersSecretRef", problems
        )
    kafka = parsed.kafka
    if parsed.backend == "kafka" and (
        kafka is None or (kafka.bootstrap_servers is None and kafka.bootstrap_servers_secret is None)
    ):
        problems.append(
            Problem(
                "spec.kafka.bootstrapServers",
                "spec.kafka.bootstrapServers or spec.kafka.bootstrapServersSecretRef is required "
                "when spec.backend is kafka",
            )
        )
    if kafka is not None:
        if kafka.bootstrap_servers is not None and kafka.bootstrap_servers_secret is not None:
            problems.append(
                Problem(
                    "spec.kafka.bootstrapServersSecretRef",
                    "is mutually exclusive with spec.kafka.bootstrapServers",
                )
            )
        if kafka.bootstrap_servers is not None and not all(
            _HOST_PORT.match(item) for item in kafka.bootstrap_servers.split(",")
        ):
            problems.append(
                Problem("spec.kafka.bootstrapServers", "must be a comma-separated host:port list")
            )
        if not _TOPIC.match(kafka.topic):
            problems.append(Problem("spec.kafka.topic", "must be a Kafka topic name"))

    worker = parsed.worker
    if not worker.image:
        problems.append(Problem("spec.worker.image", "is required"))
    if not 0 <= worker.replicas <= 1000:
        problems.append(Problem("spec.worker.replicas", "must be from 0 to 1000"))
    if not 1 <= worker.concurrency <= 256:
        problems.append(Problem("spec.worker.concurrency", "must be from 1 to 256"))
    if not 0 <= worker.shutdown_grace_s <= 3600:
        problems.append(Problem("spec.worker.shutdownGraceSeconds", "must be from 0 to 3600"))
    if not 1 <= worker.metrics_port <= 65535:
        problems.append(Problem("spec.worker.metricsPort", "must be a TCP port from 1 to 65535"))
    if not _EXECUTOR.match(worker.executor.name):
        problems.append(Problem("spec.worker.executor.name", "must be http, noop, sleep or module:function"))
    if worker.executor.name == "http" and not worker.executor.url:
        problems.append(
            Problem("spec.worker.executor.url", "is required when spec.worker.executor.name is http")
        )
    if worker.executor.url is not None and not _URL.match(worker.executor.url):
        problems.append(Problem("spec.worker.executor.url", "must be an http:// or https:// URL"))
    if worker.executor.timeout_s is not None and not 1 <= worker.executor.timeout_s <= 3600:
        problems.append(Problem("spec.worker.executor.timeoutSeconds", "must be from 1 to 3600"))
    reserved = sorted({str(e.get("name")) for e in worker.env} & set(RESERVED_ENV))
    if reserved:
        problems.append(
            Problem(
                "spec.worker.env",
                f"must not set {', '.join(reserved)}: the operator derives them from the spec "
                "(connection strings and keys come from Secret references)",
            )
        )

    auto = parsed.autoscaling
    if auto.mode not in AUTOSCALING_MODES:
        problems.append(Problem("spec.autoscaling.mode", f"must be one of {', '.join(AUTOSCALING_MODES)}"))
    if auto.max_replicas < auto.min_replicas:
        problems.append(
            Problem("spec.autoscaling.maxReplicas", "must be at least spec.autoscaling.minReplicas")
        )
    if auto.mode == "hpa" and auto.min_replicas < 1:
        problems.append(Problem("spec.autoscaling.minReplicas", "must be at least 1 with mode hpa"))
    if parsed.backend == "kafka" and auto.enabled and auto.max_replicas > parsed.partitions:
        problems.append(
            Problem("spec.autoscaling.maxReplicas", "must not exceed spec.partitions with the kafka backend")
        )
    if parsed.backend == "sqlite" and (worker.replicas > 1 or auto.enabled):
        problems.append(
            Problem(
                "spec.backend",
                "sqlite is for a single local process: spec.worker.replicas at most 1 and no autoscaling",
            )
        )
    return problems


def partition_decrease(spec_partitions: int, in_force: int | None) -> Problem | None:
    """A decrease below the partitions already in force (the topic's, or the recorded high-water
    mark), which the operator refuses even when the CRD's transition rule was bypassed."""
    if in_force is not None and spec_partitions < in_force:
        return Problem(
            "spec.partitions",
            f"cannot decrease from {in_force} to {spec_partitions} (partitions are grow-only); nothing changed",
        )
    return None
