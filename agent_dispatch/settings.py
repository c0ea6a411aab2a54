"""Every setting agent-dispatch reads, in one place.

This is the only module that reads the process environment. Entry points call
:func:`load_or_exit`, which turns a bad value into exit code 2 and one line per bad
variable naming it, the problem and the allowed range, before anything else starts.
"""

from __future__ import annotations

import re
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, Literal, NamedTuple, NoReturn, get_args

import platformdirs
from pydantic import AliasChoices, Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The recovery-time objective every lease setting is aligned with.
RTO_S: Final = 300

EXIT_INVALID_SETTING: Final = 2
#: Threads a process runs its blocking store and queue calls on (the gateway's I/O pool), and so
#: the size of each PostgreSQL connection pool: fewer connections than threads made requests
#: queue for a connection (seen in the gateway benchmark's profile) while the server had room.
IO_THREADS: Final = 16


class Bound(NamedTuple):
    """An inclusive range of a value that a setting, the operator's AgentDispatch spec and the CRD
    all carry: written once here, read by the two models, and compared with the CRD by a test."""

    low: int
    high: int


# --- the bounds and shapes shared with agent_dispatch.operator._spec (and the CRD) ---------------
PARTITIONS: Final = Bound(1, 10_000)
MAX_DEPTH: Final = Bound(1, 1_000_000_000)
CLAIM_TTL_S: Final = Bound(1, RTO_S)
#: The sweep interval's ceiling; settings take fractions of a second from 0.1, the spec whole seconds.
SWEEP_INTERVAL_S: Final = Bound(1, RTO_S)
MAX_ATTEMPTS: Final = Bound(1, 100)
CONCURRENCY: Final = Bound(1, 256)
SHUTDOWN_GRACE_S: Final = Bound(0, 3600)
EXECUTOR_TIMEOUT_S: Final = Bound(1, 3600)
# Patterns are ASCII and RE2-compatible: the API server checks the CRD's copies with Go's regexp.
KAFKA_TOPIC_PATTERN: Final = r"^[A-Za-z0-9._-]+$"
KAFKA_TOPIC_LENGTH: Final = Bound(1, 249)
EXECUTOR_PATTERN: Final = r"^(noop|sleep|http|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$"
EXECUTOR_URL_PATTERN: Final = r"^https?://\S+$"
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LOG_LEVELS: Final = get_args(LogLevel)


class Backend(StrEnum):
    KAFKA = "kafka"
    POSTGRES = "postgres"
    SQLITE = "sqlite"


class LogFormat(StrEnum):
    JSON = "json"
    TEXT = "text"


def _env(name: str) -> Any:
    """A field read from exactly one environment variable, also settable by field name in code."""
    return AliasChoices(name)


#: Allowed values, quoted in error messages; keep in step with the Field constraints below.
ALLOWED: Final[dict[str, str]] = {
    "TASK_QUEUE_BACKEND": "one of kafka, postgres, sqlite (unset: postgres when STATE_DB_URI is set, else sqlite)",
    "AGENT_TURNS_PARTITIONS": f"an integer from {PARTITIONS.low} to {PARTITIONS.high}; grow-only",
    "AGENT_DISPATCH_MAX_DEPTH": f"an integer from {MAX_DEPTH.low} to {MAX_DEPTH.high}",
    "AGENT_DISPATCH_CLAIM_TTL_S": f"a number of seconds from {CLAIM_TTL_S.low} to {CLAIM_TTL_S.high} (the RTO)",
    "AGENT_DISPATCH_RENEW_INTERVAL_S": "a number of seconds from 0.1 up to, but not including, the claim TTL",
    "AGENT_DISPATCH_VISIBILITY_TIMEOUT_S": f"a number of seconds from 1 to {RTO_S} (the RTO)",
    "AGENT_DISPATCH_SWEEP_INTERVAL_S": f"a number of seconds from 0.1 to {SWEEP_INTERVAL_S.high}",
    "AGENT_DISPATCH_MAX_ATTEMPTS": f"an integer from {MAX_ATTEMPTS.low} to {MAX_ATTEMPTS.high}",
    "AGENT_DISPATCH_MAX_PAYLOAD_BYTES": "an integer from 1 to 67108864 (64 MiB)",
    "STATE_DB_URI": "a postgresql:// or postgres:// connection URI",
    "KAFKA_BOOTSTRAP_SERVERS": "a comma-separated list of host:port",
    "AGENT_DISPATCH_SIGNING_KEY": "at least 32 characters",
    "AGENT_DISPATCH_DATA_DIR": "a directory path",
    "AGENT_DISPATCH_LOG_LEVEL": "one of DEBUG, INFO, WARNING, ERROR",
    "AGENT_DISPATCH_LOG_FORMAT": "one of json, text",
    "AGENT_DISPATCH_KAFKA_TOPIC": "a Kafka topic name (letters, digits, '.', '_', '-'; up to 249)",
    "AGENT_DISPATCH_KAFKA_GROUP": "a Kafka consumer group id",
    "AGENT_DISPATCH_METRICS_PORT": "a TCP port from 0 to 65535 (0: do not serve)",
    "AGENT_DISPATCH_CONCURRENCY": f"an integer from {CONCURRENCY.low} to {CONCURRENCY.high} worker threads",
    "AGENT_DISPATCH_CLAIM_BATCH": "an integer from 1 to 256 deliveries per claim",
    "AGENT_DISPATCH_EXECUTOR": "noop, sleep, http, or a plugin as module:function",
    "AGENT_DISPATCH_EXECUTOR_URL": "an http:// or https:// URL (required for the http executor)",
    "AGENT_DISPATCH_EXECUTOR_TIMEOUT_S": f"a number of seconds from 0.1 to {EXECUTOR_TIMEOUT_S.high}",
    "AGENT_DISPATCH_SHUTDOWN_GRACE_S": f"a number of seconds from {SHUTDOWN_GRACE_S.low} to {SHUTDOWN_GRACE_S.high}",
    "AGENT_DISPATCH_INSTANCE": "the AgentDispatch resource name (a DNS-1123 label)",
    "AGENT_DISPATCH_NAMESPACE": "a Kubernetes namespace (a DNS-1123 label)",
    "AGENT_DISPATCH_WORKER_ID": "letters, digits, '.', '_', '-' (up to 200)",
    "AGENT_DISPATCH_POD_UID": "the worker pod's uid (a UUID, from the downward API)",
    "AGENT_DISPATCH_GATEWAY_HOST": "an IP address or host name to listen on (default 127.0.0.1)",
    "AGENT_DISPATCH_GATEWAY_PORT": "a TCP port from 0 to 65535 (0: any free port)",
    "AGENT_DISPATCH_TOKENS_FILE": "a file (YAML or JSON) mapping each tenant to the sha256 hex of its bearer token",
    "AGENT_DISPATCH_GATEWAY_URL": "an http:// or https:// URL of a gateway (used by submit and jobs)",
    "AGENT_DISPATCH_TOKEN": "a bearer token of 16 to 4096 printable characters (used by submit and jobs)",
}


class Settings(BaseSettings):
    """Validated configuration; construct with :func:`load_or_exit` in entry points."""

    model_config = SettingsConfigDict(
        case_sensitive=True,
        populate_by_name=True,
        extra="ignore",
        frozen=True,
        env_ignore_empty=True,
        validate_default=False,
    )

    backend_choice: Backend | None = Field(None, validation_alias=_env("TASK_QUEUE_BACKEND"))
    partitions: Annotated[int, Field(ge=PARTITIONS.low, le=PARTITIONS.high)] = Field(
        6, validation_alias=_env("AGENT_TURNS_PARTITIONS")
    )
    max_depth: Annotated[int, Field(ge=MAX_DEPTH.low, le=MAX_DEPTH.high)] = Field(
        100_000, validation_alias=_env("AGENT_DISPATCH_MAX_DEPTH")
    )
    claim_ttl_s: Annotated[float, Field(ge=CLAIM_TTL_S.low, le=CLAIM_TTL_S.high)] = Field(
        120, validation_alias=_env("AGENT_DISPATCH_CLAIM_TTL_S")
    )
    renew_interval_s: Annotated[float, Field(ge=0.1)] = Field(
        30, validation_alias=_env("AGENT_DISPATCH_RENEW_INTERVAL_S")
    )
    visibility_timeout_s: Annotated[float, Field(ge=1, le=RTO_S)] | None = Field(
        None, validation_alias=_env("AGENT_DISPATCH_VISIBILITY_TIMEOUT_S")
    )
    sweep_interval_s: Annotated[float, Field(ge=0.1, le=SWEEP_INTERVAL_S.high)] = Field(
        15, validation_alias=_env("AGENT_DISPATCH_SWEEP_INTERVAL_S")
    )
    max_attempts: Annotated[int, Field(ge=MAX_ATTEMPTS.low, le=MAX_ATTEMPTS.high)] = Field(
        5, validation_alias=_env("AGENT_DISPATCH_MAX_ATTEMPTS")
    )
    max_payload_bytes: Annotated[int, Field(ge=1, le=64 * 1024 * 1024)] = Field(
        1024 * 1024, validation_alias=_env("AGENT_DISPATCH_MAX_PAYLOAD_BYTES")
    )
    state_db_uri: SecretStr | None = Field(None, validation_alias=_env("STATE_DB_URI"), validate_default=True)
    kafka_bootstrap_servers: str | None = Field(
        None, validation_alias=_env("KAFKA_BOOTSTRAP_SERVERS"), validate_default=True
    )
    kafka_topic: Annotated[
        str,
        Field(
            pattern=KAFKA_TOPIC_PATTERN, min_length=KAFKA_TOPIC_LENGTH.low, max_length=KAFKA_TOPIC_LENGTH.high
        ),
    ] = Field("agent_turns", validation_alias=_env("AGENT_DISPATCH_KAFKA_TOPIC"))
    kafka_group: Annotated[str, Field(min_length=1, max_length=255)] = Field(
        "agent-dispatch", validation_alias=_env("AGENT_DISPATCH_KAFKA_GROUP")
    )
    signing_key: SecretStr | None = Field(None, validation_alias=_env("AGENT_DISPATCH_SIGNING_KEY"))
    data_dir: Path = Field(
        default_factory=lambda: Path(platformdirs.user_data_dir("agent-dispatch", appauthor=False)),
        validation_alias=_env("AGENT_DISPATCH_DATA_DIR"),
    )
    log_level: Annotated[str, Field(pattern=f"^({'|'.join(LOG_LEVELS)})$")] = Field(
        "INFO", validation_alias=_env("AGENT_DISPATCH_LOG_LEVEL")
    )
    log_format: LogFormat = Field(LogFormat.JSON, validation_alias=_env("AGENT_DISPATCH_LOG_FORMAT"))
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        9464, validation_alias=_env("AGENT_DISPATCH_METRICS_PORT")
    )

    concurrency: Annotated[int, Field(ge=CONCURRENCY.low, le=CONCURRENCY.high)] = Field(
        4, validation_alias=_env("AGENT_DISPATCH_CONCURRENCY")
    )
    claim_batch: Annotated[int, Field(ge=1, le=256)] = Field(
        64, validation_alias=_env("AGENT_DISPATCH_CLAIM_BATCH")
    )
    executor: Annotated[str, Field(pattern=EXECUTOR_PATTERN)] = Field(
        "noop", validation_alias=_env("AGENT_DISPATCH_EXECUTOR")
    )
    executor_url: Annotated[str, Field(pattern=EXECUTOR_URL_PATTERN)] | None = Field(
        None, validation_alias=_env("AGENT_DISPATCH_EXECUTOR_URL"), validate_default=True
    )
    executor_timeout_s: Annotated[float, Field(ge=0.1, le=EXECUTOR_TIMEOUT_S.high)] = Field(
        300, validation_alias=_env("AGENT_DISPATCH_EXECUTOR_TIMEOUT_S")
    )
    shutdown_grace_s: Annotated[float, Field(ge=SHUTDOWN_GRACE_S.low, le=SHUTDOWN_GRACE_S.high)] = Field(
        30, validation_alias=_env("AGENT_DISPATCH_SHUTDOWN_GRACE_S")
    )
    instance: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")] | None = Field(
        None, validation_alias=_env("AGENT_DISPATCH_INSTANCE")
    )
    namespace: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")] | None = Field(
        None, validation_alias=AliasChoices("AGENT_DISPATCH_NAMESPACE", "POD_NAMESPACE")
    )
    worker_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,200}$")] | None = Field(
        None, validation_alias=AliasChoices("AGENT_DISPATCH_WORKER_ID", "POD_NAME")
    )
    pod_uid: Annotated[str, Field(pattern=r"^[0-9a-fA-F-]{1,64}$")] | None = Field(
        None, validation_alias=_env("AGENT_DISPATCH_POD_UID")
    )

    gateway_host: Annotated[str, Field(pattern=r"^[A-Za-z0-9.:_\[\]-]{1,253}$")] = Field(
        "127.0.0.1", validation_alias=_env("AGENT_DISPATCH_GATEWAY_HOST")
    )
    gateway_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        8080, validation_alias=_env("AGENT_DISPATCH_GATEWAY_PORT")
    )
    tokens_file: Path | None = Field(None, validation_alias=_env("AGENT_DISPATCH_TOKENS_FILE"))
    gateway_url: Annotated[str, Field(pattern=r"^https?://[^\s/]+(/\S*)?$")] | None = Field(
        None, validation_alias=_env("AGENT_DISPATCH_GATEWAY_URL")
    )
    # The client side of the gateway's bearer auth; a secret, so never echoed in errors.
    token: SecretStr | None = Field(None, validation_alias=_env("AGENT_DISPATCH_TOKEN"))

    kubeconfig: Path | None = Field(None, validation_alias=_env("KUBECONFIG"))
    kubernetes_service_host: str | None = Field(None, validation_alias=_env("KUBERNETES_SERVICE_HOST"))

    @field_validator("executor_url", mode="after")
    @classmethod
    def _http_needs_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("executor") == "http" and value is None:
            raise ValueError("is required when AGENT_DISPATCH_EXECUTOR=http")
        return value

    @field_validator("renew_interval_s")
    @classmethod
    def _renew_below_ttl(cls, value: float, info: ValidationInfo) -> float:
        ttl = info.data.get("claim_ttl_s")
        if ttl is not None and value >= ttl:
            raise ValueError(f"must be below AGENT_DISPATCH_CLAIM_TTL_S ({ttl:g} s)")
        return value

    @field_validator("state_db_uri")
    @classmethod
    def _postgres_uri(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().startswith(("postgresql://", "postgres://")):
            # Never echo the value: a connection URI may carry a password.
            raise ValueError("must start with postgresql:// or postgres://")
        return value

    @field_validator("kafka_bootstrap_servers")
    @classmethod
    def _host_ports(cls, value: str | None) -> str | None:
        if value is None:
            return value
        for item in value.split(","):
            host, sep, port = item.strip().rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{item.strip()!r} is not host:port")
        return value

    @field_validator("token")
    @classmethod
    def _token_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not re.fullmatch(r"[\x21-\x7e]{16,4096}", value.get_secret_value()):
            raise ValueError("is not 16 to 4096 printable characters without spaces")
        return value

    @field_validator("signing_key")
    @classmethod
    def _key_length(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("is too short to be a signing key")
        return value

    @field_validator("kafka_bootstrap_servers", mode="after")
    @classmethod
    def _kafka_needs_servers(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("backend_choice") is Backend.KAFKA and not value:
            raise ValueError("is required when TASK_QUEUE_BACKEND=kafka")
        return value

    @field_validator("state_db_uri", mode="after")
    @classmethod
    def _postgres_needs_uri(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if info.data.get("backend_choice") is Backend.POSTGRES and value is None:
            raise ValueError("is required when TASK_QUEUE_BACKEND=postgres")
        return value

    @property
    def backend(self) -> Backend:
        """The transport in force: the explicit choice, else postgres with STATE_DB_URI, else sqlite."""
        if self.backend_choice is not None:
            return self.backend_choice
        return Backend.POSTGRES if self.state_db_uri is not None else Backend.SQLITE

    @property
    def backend_explicit(self) -> bool:
        return self.backend_choice is not None

    @property
    def effective_visibility_timeout_s(self) -> float:
        """Queue visibility timeout: explicit, else the claim TTL (both within the RTO)."""
        return self.visibility_timeout_s if self.visibility_timeout_s is not None else self.claim_ttl_s

    @property
    def effective_renew_interval_s(self) -> float:
        """The lease guard renews at the configured interval, and never less often than TTL/3."""
        return min(self.renew_interval_s, self.claim_ttl_s / 3)

    @property
    def in_cluster(self) -> bool:
        return self.kubernetes_service_host is not None

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "agent-dispatch.sqlite3"


# Field name -> the environment variable it is read from, for error messages.
ENV_NAMES: Final[dict[str, str]] = {
    name: str(field.validation_alias.choices[0])  # type: ignore[union-attr]
    for name, field in Settings.model_fields.items()
}


#: Variables whose values are secrets: an error line names them but never shows the value.
SECRET_ENV: Final = frozenset({"STATE_DB_URI", "AGENT_DISPATCH_SIGNING_KEY", "AGENT_DISPATCH_TOKEN"})


class InvalidSetting(ValueError):
    """One or more settings are invalid; ``lines`` has one message per bad variable."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def describe_errors(error: ValidationError, given: dict[str, Any] | None = None) -> list[str]:
    """One line per bad variable: its name, the value's problem and the allowed range."""
    lines: list[str] = []
    seen: set[str] = set()
    for item in error.errors(include_url=False):
        loc = str(item["loc"][0]) if item["loc"] else ""
        env = ENV_NAMES.get(loc, loc)
        if env in seen:
            continue
        seen.add(env)
        problem = str(item["msg"]).removeprefix("Value error, ")
        shown = "" if env in SECRET_ENV else _shown_value(item.get("input"))
        allowed = ALLOWED.get(env, "see the configuration table in the README")
        lines.append(f"invalid setting {env}{shown}: {problem}; allowed: {allowed}")
    return lines


def _shown_value(value: Any) -> str:
    if value is None or isinstance(value, dict):
        return ""
    text = str(value)
    return f"={text[:40]!r}"


def load(**overrides: Any) -> Settings:
    """Read and validate the settings; raise :class:`InvalidSetting` on a bad value."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise InvalidSetting(describe_errors(exc)) from None


def load_or_exit(program: str = "agent-dispatch", **overrides: Any) -> Settings:
    """Entry points call this first: bad configuration stops the process with exit code 2."""
    try:
        return load(**overrides)
    except InvalidSetting as exc:
        exit_invalid(program, exc.lines)


def exit_invalid(program: str, lines: list[str]) -> NoReturn:
    for line in lines:
        print(f"{program}: {line}", file=sys.stderr)
    raise SystemExit(EXIT_INVALID_SETTING)
