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
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from agent_dispatch.settings import RTO_S, Settings

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
        "data_dir": "set" if "AGENT_DISPATCH_DATA_DIR" in os.environ else "default",
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
    for probe in probes:
        try:
            checks.extend(probe(settings))
        except Exception as exc:  # a probe that breaks is itself a finding, never a crash
            checks.append(Check(getattr(probe, "__name__", "probe"), "fail", f"{type(exc).__name__}: {exc}"))
    return [redact_check(check, settings) for check in checks]


def overall(checks: Iterable[Check]) -> Status:
    statuses = {c.status for c in checks}
    return "fail" if "fail" in statuses else "warn" if "warn" in statuses else "ok"


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
    return {w for w in words if w and len(w) > 1}


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
