"""Operator-side validation of an AgentDispatch spec: defence in depth behind the CRD.

The API server already rejects these specs (the CRD's schema and CEL rules), but an object can
reach the operator without those rules (the CRD installed by an older chart, a rule disabled by
an administrator, an object stored before a rule existed). An invalid spec sets
``ConfigValid=False`` (and ``Ready=False``) naming the field, and changes nothing.

Field shapes and bounds are the model's (:mod:`agent_dispatch.operator._spec`); the rules across
fields below are the CRD's CEL rules, in the same order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic_core import ErrorDetails

from agent_dispatch.operator._spec import MAX_NAME_LENGTH, RESERVED_ENV, DispatchSpec, InvalidSpec, parse

_DNS_LABEL: Final = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class Problem:
    """One reason a spec is invalid: the field path and what is wrong with it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _path(loc: Sequence[int | str]) -> str:
    return ".".join(["spec", *(str(part) for part in loc)])


def _message(error: ErrorDetails) -> str:
    """pydantic's reason, worded like the CRD's messages ("must be at most 300")."""
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    worded = {
        "missing": "is required",
        "int_type": "must be an integer",
        "string_type": "must be a string",
        "greater_than_equal": f"must be at least {ctx.get('ge')}",
        "less_than_equal": f"must be at most {ctx.get('le')}",
        "string_too_short": f"must be at least {ctx.get('min_length')} characters",
        "string_too_long": f"must be at most {ctx.get('max_length')} characters",
        "too_long": f"must have at most {ctx.get('max_length')} items",
        "string_pattern_mismatch": f"must match {ctx.get('pattern')}",
        "literal_error": f"must be one of {ctx.get('expected')}",
    }
    return worded.get(error["type"], str(error["msg"]).removeprefix("Value error, "))


def field_problems(exc: InvalidSpec) -> list[Problem]:
    return [Problem(_path(e["loc"]), _message(e)) for e in exc.error.errors(include_url=False)]


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
    try:
        parsed = parse(spec)
    except InvalidSpec as exc:
        return problems + field_problems(exc)
    return problems + cross_field_problems(parsed)


def cross_field_problems(spec: DispatchSpec) -> list[Problem]:
    """The CRD's CEL rules across fields (transition rules aside: see :func:`partition_decrease`)."""
    problems: list[Problem] = []

    def need(ok: bool, field: str, message: str) -> None:
        if not ok:
            problems.append(Problem(field, message))

    need(
        spec.renew_interval_s < spec.claim_ttl_s,
        "spec.renewIntervalSeconds",
        "must be below spec.claimTtlSeconds",
    )
    need(
        spec.backend != "postgres" or spec.dsn_secret is not None,
        "spec.postgres.dsnSecretRef",
        "is required when spec.backend is postgres",
    )
    need(
        spec.backend == "sqlite" or spec.signing_key_secret is not None,
        "spec.signingKeySecretRef",
        "is required when spec.backend is postgres or kafka (workers and gateways share one key)",
    )
    kafka = spec.kafka
    need(
        spec.backend != "kafka"
        or (kafka is not None and (kafka.bootstrap_servers or kafka.bootstrap_servers_secret) is not None),
        "spec.kafka.bootstrapServers",
        "spec.kafka.bootstrapServers or spec.kafka.bootstrapServersSecretRef is required "
        "when spec.backend is kafka",
    )
    need(
        kafka is None or kafka.bootstrap_servers is None or kafka.bootstrap_servers_secret is None,
        "spec.kafka.bootstrapServersSecretRef",
        "is mutually exclusive with spec.kafka.bootstrapServers",
    )
    auto, worker = spec.autoscaling, spec.worker
    need(
        spec.backend != "kafka" or not auto.enabled or auto.max_replicas <= spec.partitions,
        "spec.autoscaling.maxReplicas",
        "must not exceed spec.partitions with the kafka backend",
    )
    need(
        spec.backend != "sqlite" or (worker.replicas <= 1 and not auto.enabled),
        "spec.backend",
        "sqlite is for a single local process: spec.worker.replicas at most 1 and no autoscaling",
    )
    reserved = sorted({str(e.get("name")) for e in worker.env} & set(RESERVED_ENV))
    need(
        not reserved,
        "spec.worker.env",
        f"must not set {', '.join(reserved)}: the operator derives them from the spec "
        "(connection strings and keys come from Secret references)",
    )
    need(
        worker.executor.name != "http" or worker.executor.url is not None,
        "spec.worker.executor.url",
        "is required when spec.worker.executor.name is http",
    )
    need(
        auto.max_replicas >= auto.min_replicas,
        "spec.autoscaling.maxReplicas",
        "must be at least spec.autoscaling.minReplicas",
    )
    need(
        auto.mode != "hpa" or auto.min_replicas >= 1,
        "spec.autoscaling.minReplicas",
        "must be at least 1 with mode hpa",
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
