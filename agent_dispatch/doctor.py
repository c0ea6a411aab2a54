"""The doctor: checks that say whether this installation can keep its promises.

Its report goes to terminals, JSON consumers and the AgentDispatch ``.status``, so it must
never carry hostnames, usernames or filesystem paths (they are redacted at the source and
again on the way out).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

from agent_dispatch.settings import RTO_S, Backend, Settings

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: A probe adds checks that need live components (transport, schema, heartbeats).
Probe = Callable[[Settings], Iterable[Check]]


def lease_recovery(settings: Settings) -> Check:
    """``dispatch_lease_recovery``: an expired lease is re-driven within the RTO."""
    ttl = settings.claim_ttl_s
    renew = settings.effective_renew_interval_s
    worst_case = ttl + settings.sweep_interval_s
    data = {
        "claim_ttl_s": ttl,
        "renew_interval_s": renew,
        "sweep_interval_s": settings.sweep_interval_s,
        "rto_s": RTO_S,
        "worst_case_recovery_s": worst_case,
    }
    problems = []
    if ttl > RTO_S:
        problems.append(f"claim TTL {ttl:g}s exceeds the {RTO_S}s RTO")
    if renew >= ttl:
        problems.append(f"renew interval {renew:g}s is not below the claim TTL {ttl:g}s")
    if problems:
        return Check("dispatch_lease_recovery", "fail", "; ".join(problems), data)
    if worst_case > RTO_S:
        return Check(
            "dispatch_lease_recovery",
            "warn",
            f"claim TTL + sweep interval = {worst_case:g}s exceeds the {RTO_S}s RTO",
            data,
        )
    detail = f"claim TTL {ttl:g}s, renew every {renew:g}s, recovery within {worst_case:g}s of {RTO_S}s RTO"
    return Check("dispatch_lease_recovery", "ok", detail, data)


def settings_report(settings: Settings) -> Check:
    """The settings in force, with anything that could name a host, user or path left out."""
    data: dict[str, Any] = {
        "backend": settings.backend.value,
        "backend_explicit": settings.backend_explicit,
        "partitions": settings.partitions,
        "max_depth": settings.max_depth,
        "claim_ttl_s": settings.claim_ttl_s,
        "renew_interval_s": settings.renew_interval_s,
        "visibility_timeout_s": settings.effective_visibility_timeout_s,
        "max_attempts": settings.max_attempts,
        "max_payload_bytes": settings.max_payload_bytes,
        "state_db_uri": "set" if settings.state_db_uri else "unset",
        "kafka_bootstrap_servers": (
            f"{len(settings.kafka_bootstrap_servers.split(','))} configured"
            if settings.kafka_bootstrap_servers
            else "unset"
        ),
        "kafka_topic": settings.kafka_topic,
        "signing_key": "set" if settings.signing_key else "unset",
        "data_dir": "set" if "data_dir" in settings.model_fields_set else "default",
    }
    return Check("settings", "ok", f"valid; backend {settings.backend.value}", data)


def signing_key(settings: Settings) -> Check:
    if settings.signing_key is None:
        return Check(
            "signing_key",
            "warn",
            "AGENT_DISPATCH_SIGNING_KEY is unset: local runs generate one; production must set it",
        )
    return Check("signing_key", "ok", "present")


def run(settings: Settings, probes: Iterable[Probe] = ()) -> list[Check]:
    checks = [settings_report(settings), lease_recovery(settings), signing_key(settings)]
    checks.extend(run_probes(settings, tuple(probes)))
    return [redact_check(check, settings) for check in checks]


def overall(checks: Iterable[Check]) -> Status:
    statuses = {c.status for c in checks}
    return "fail" if "fail" in statuses else "warn" if "warn" in statuses else "ok"


def exit_code(checks: Iterable[Check]) -> int:
    """The CLI's exit code for a report, by the one rule (:mod:`agent_dispatch.runtime`): 3 when a
    required service was unreachable, 1 for any other failure, else 0."""
    from agent_dispatch.runtime import EXIT_FAILURE, EXIT_OK, EXIT_UNAVAILABLE

    failed = [c for c in checks if c.status == "fail"]
    if any(c.data.get("unreachable") for c in failed):
        return EXIT_UNAVAILABLE
    return EXIT_FAILURE if failed else EXIT_OK


# --- redaction -------------------------------------------------------------------------------

_PATH = re.compile(r"(?<![\w.:/-])(?:~|\.{1,2})?/(?:[^\s/'\",;:)]+/?)+")
_HOST_PORT = re.compile(r"\b(?:[A-Za-z0-9-]+\.)*[A-Za-z0-9-]+:\d{2,5}\b")
_URI_AUTHORITY = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/\s]+")


def _sensitive_words(settings: Settings | None) -> set[str]:
    words = {socket.gethostname(), socket.getfqdn(), os.environ.get("HOSTNAME", "")}
    with contextlib.suppress(KeyError, OSError):
        words.add(getpass.getuser())
    words.update({os.environ.get("USER", ""), os.environ.get("LOGNAME", "")})
    if settings is not None and settings.kafka_bootstrap_servers:
        words.update(item.rsplit(":", 1)[0].strip() for item in settings.kafka_bootstrap_servers.split(","))
    if settings is not None and settings.state_db_uri is not None:
        words.update(_uri_words(settings.state_db_uri.get_secret_value()))
    if settings is not None:
        # Paths are caught by shape too; these also catch them quoted or relative.
        for path in (settings.data_dir, settings.tokens_file, settings.kubeconfig):
            if path is not None:
                words.update({str(path), str(path.expanduser())})
    return {w for w in words if w and len(w) > 1}


_PRODUCT_WORDS: Final = frozenset({*(b.value for b in Backend), "postgresql", "localhost"})


def _uri_words(uri: str) -> set[str]:
    """User, hosts and database of a connection URI: drivers echo them without the URI's shape."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return set()
    user, _, hosts = parts.netloc.rpartition("@")
    words = {user.split(":", 1)[0]}
    words.update(h.rsplit(":", 1)[0].strip("[]") for h in hosts.split(","))
    for key, values in urllib.parse.parse_qs(parts.query).items():
        if key in {"host", "user", "hostaddr"}:
            words.update(values)
    # A stock role named like the product ("postgres") identifies nobody; redacting it would
    # garble every line that names the backend.
    return words - _PRODUCT_WORDS


def redact(text: str, settings: Settings | None = None) -> str:
    """Remove URI authorities, host:port pairs, filesystem paths, this host's names and user names."""
    text = _URI_AUTHORITY.sub(r"\1<redacted>", text)
    text = _HOST_PORT.sub("<host>", text)
    text = _PATH.sub("<path>", text)
    for word in sorted(_sensitive_words(settings), key=len, reverse=True):
        text = re.sub(rf"(?<![\w-]){re.escape(word)}(?![\w-])", "<redacted>", text)
    return text


def _redact_value(value: Any, settings: Settings | None) -> Any:
    if isinstance(value, str):
        return redact(value, settings)
    if isinstance(value, dict):
        return {k: _redact_value(v, settings) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_value(v, settings) for v in value]
    return value


def redact_check(check: Check, settings: Settings | None = None) -> Check:
    return Check(
        check.name, check.status, redact(check.detail, settings), _redact_value(check.data, settings)
    )


# --- live probes ------------------------------------------------------------------------------
#
# Each probe opens what the settings name, looks, and closes it again. They run concurrently
# under one deadline, so an unreachable broker or database makes the doctor slow by at most
# PROBE_TIMEOUT_S, never hang. Their text goes through the same redaction as everything else.

PROBE_TIMEOUT_S: Final = 15.0


def _sqlite_missing(settings: Settings) -> Check | None:
    # The doctor looks; it never creates the local database as a side effect of looking.
    if (
        settings.backend is Backend.SQLITE
        and settings.state_db_uri is None
        and not settings.sqlite_path.exists()
    ):
        return Check(
            "transport",
            "warn",
            "the local SQLite database does not exist yet; `agent-dispatch migrate` or `agent-dispatch up` creates it",
            {"backend": "sqlite"},
        )
    return None


def transport_probe(settings: Settings) -> Iterable[Check]:
    """Reachability, queue depth against the bound, and (Kafka) the topic's partitions."""
    from agent_dispatch.errors import DepthUnavailable
    from agent_dispatch.runtime import open_transport

    missing = _sqlite_missing(settings)
    if missing is not None:
        return [missing]
    backend = settings.backend.value
    transport = open_transport(settings)
    try:
        try:
            depth = transport.depth()
        except DepthUnavailable as exc:
            return [Check("transport", "fail", f"{backend} reachable, but the depth probe failed: {exc}")]
    finally:
        transport.close()
    partitions = _kafka_partitions(settings) if settings.backend is Backend.KAFKA else settings.partitions
    data: dict[str, Any] = {
        "backend": backend,
        "depth": depth,
        "max_depth": settings.max_depth,
        "utilisation": round(depth / settings.max_depth, 4),
        "partitions": partitions,
    }
    detail = f"{backend} reachable; depth {depth} of {settings.max_depth}"
    status: Status = "warn" if depth >= settings.max_depth else "ok"
    if settings.backend is Backend.KAFKA:
        # The lag counts re-driven duplicates and uncommitted offsets: a signal for autoscaling,
        # not the bound (the store's count of unfinished turns is; see the schema check).
        detail = f"{backend} reachable; consumer-group lag {depth} (the autoscaling signal, not the bound)"
        detail += f"; topic has {partitions} partitions (configured {settings.partitions})"
        status = "ok"
    if status == "warn":
        detail += "; the queue is full: new turns are refused (429)"
    return [Check("transport", status, detail, data)]


def _kafka_partitions(settings: Settings) -> int | None:
    from agent_dispatch.transports import kafka

    admin = kafka.admin_client(settings.kafka_bootstrap_servers or "", client_id="agent-dispatch-doctor")
    return kafka.topic_partition_count(admin, settings.kafka_topic, timeout_s=PROBE_TIMEOUT_S / 2)


def schema_probe(settings: Settings) -> Iterable[Check]:
    """The WorkItem schema is at the version this code needs (else: run `agent-dispatch migrate`)."""
    from agent_dispatch.errors import SchemaOutdated
    from agent_dispatch.runtime import open_store
    from agent_dispatch.store import SCHEMA_VERSION

    if settings.state_db_uri is None and not settings.sqlite_path.exists():
        return [Check("schema", "warn", "no local database yet; `agent-dispatch migrate` creates it")]
    from agent_dispatch.store import CountsUnfinished

    store = open_store(settings)
    try:
        # Any read checks the schema version first; a tenant nobody has keeps it O(1).
        store.list_items(tenant="doctor.schema-probe", limit=1)
        unfinished = store.unfinished() if isinstance(store, CountsUnfinished) else None
    except SchemaOutdated as exc:
        return [Check("schema", "fail", str(exc), {"required": SCHEMA_VERSION})]
    finally:
        store.close()
    data: dict[str, Any] = {"version": SCHEMA_VERSION}
    detail = f"current (version {SCHEMA_VERSION})"
    if unfinished is None:
        return [Check("schema", "ok", detail, data)]
    # Accepted, unfinished turns: what AGENT_DISPATCH_MAX_DEPTH bounds on every transport.
    data.update(unfinished=unfinished, max_depth=settings.max_depth)
    detail += f"; {unfinished} unfinished turns of the bound {settings.max_depth}"
    if unfinished >= settings.max_depth:
        return [Check("schema", "warn", detail + ": new turns are refused (429)", data)]
    return [Check("schema", "ok", detail, data)]


def heartbeat_probe(settings: Settings) -> Iterable[Check]:
    """Worker heartbeats from their coordination.k8s.io Leases, when this process can see the cluster."""
    from agent_dispatch import k8s_names
    from agent_dispatch.k8s_client import new_api_client

    if not (settings.instance and settings.namespace):
        return [
            Check(
                "worker_heartbeats",
                "ok",
                "not visible here (set AGENT_DISPATCH_INSTANCE and AGENT_DISPATCH_NAMESPACE in a cluster)",
            )
        ]
    api_client = new_api_client(settings.kubeconfig, default_kubeconfig=False)
    if api_client is None:
        return [Check("worker_heartbeats", "ok", "not visible here (no Kubernetes credentials)")]
    from datetime import UTC, datetime

    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    coordination = client.CoordinationV1Api(api_client)
    try:
        leases = coordination.list_namespaced_lease(
            settings.namespace,
            label_selector=k8s_names.worker_lease_selector(settings.instance),
            _request_timeout=PROBE_TIMEOUT_S / 2,
        )
    except ApiException as exc:
        if exc.status != 403:
            raise
        # A worker pod may not list Leases (least privilege: it gets, renews and deletes its own),
        # so inside one the doctor reports that worker's heartbeat; the operator's status has all.
        return _own_heartbeat(coordination, settings)
    now = datetime.now(UTC)
    live = stale = 0
    for lease in leases.items:
        spec = lease.spec
        renewed = spec.renew_time if spec is not None else None
        duration = (spec.lease_duration_seconds if spec is not None else None) or 0
        if renewed is not None and (now - renewed).total_seconds() <= duration:
            live += 1
        else:
            stale += 1
    data = {"live": live, "stale": stale}
    if live == 0:
        return [Check("worker_heartbeats", "warn", f"no live workers ({stale} stale)", data)]
    return [Check("worker_heartbeats", "ok", f"{live} live workers, {stale} stale", data)]


def _own_heartbeat(coordination: Any, settings: Settings) -> list[Check]:
    from datetime import UTC, datetime

    from kubernetes.client.exceptions import ApiException

    from agent_dispatch.worker import lease_name

    if not (settings.worker_id and settings.instance and settings.namespace):
        return [Check("worker_heartbeats", "ok", "not visible with this identity (it may not list Leases)")]
    try:
        lease = coordination.read_namespaced_lease(
            lease_name(settings.instance, settings.worker_id),
            settings.namespace,
            _request_timeout=PROBE_TIMEOUT_S / 2,
        )
    except ApiException as exc:
        if exc.status == 404:
            return [
                Check("worker_heartbeats", "warn", "this worker's Lease does not exist (not renewed yet?)")
            ]
        raise
    renewed = lease.spec.renew_time if lease.spec is not None else None
    age = (datetime.now(UTC) - renewed).total_seconds() if renewed is not None else None
    duration = (lease.spec.lease_duration_seconds if lease.spec is not None else None) or 0
    data = {"renewed_s_ago": round(age, 1) if age is not None else None, "duration_s": duration}
    if age is None or age > duration:
        return [Check("worker_heartbeats", "warn", "this worker's Lease is stale", data)]
    return [Check("worker_heartbeats", "ok", f"this worker's Lease renewed {age:.0f}s ago", data)]


#: What ``agent-dispatch doctor`` runs besides the static checks.
LIVE_PROBES: Final[tuple[Probe, ...]] = (transport_probe, schema_probe, heartbeat_probe)


def run_probes(
    settings: Settings, probes: Sequence[Probe], timeout_s: float = PROBE_TIMEOUT_S
) -> list[Check]:
    """Run probes concurrently; one that fails or overruns the deadline becomes a failed check."""
    results: dict[int, list[Check]] = {}

    from agent_dispatch.runtime import EXIT_UNAVAILABLE, StartupError, exit_code_for

    def attempt(index: int, probe: Probe) -> None:
        try:
            results[index] = list(probe(settings))
        except Exception as exc:  # a probe that breaks is itself a finding, never a crash
            detail = str(exc) if isinstance(exc, StartupError) else f"{type(exc).__name__}: {exc}"
            data = {"unreachable": True} if exit_code_for(exc) == EXIT_UNAVAILABLE else {}
            results[index] = [Check(_probe_name(probe), "fail", detail, data)]

    # Daemon threads, not a pool: a probe stuck in a driver must not keep the process alive.
    threads = [
        threading.Thread(target=attempt, args=(i, p), name="doctor-probe", daemon=True)
        for i, p in enumerate(probes)
    ]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    checks: list[Check] = []
    for index, probe in enumerate(probes):
        found = results.get(index)
        checks.extend(
            found
            if found is not None
            # A service that does not answer in time is as unusable as one that refuses.
            else [
                Check(_probe_name(probe), "fail", f"no answer within {timeout_s:g}s", {"unreachable": True})
            ]
        )
    return checks


def _probe_name(probe: Probe) -> str:
    return getattr(probe, "__name__", "probe").removesuffix("_probe")
