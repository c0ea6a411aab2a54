"""Pure functions that turn what the operator observed into the AgentDispatch ``.status``.

Workers are counted from their heartbeat Leases (the node-lease pattern): a Lease is live while
``renewTime + leaseDurationSeconds`` is in the future, so a killed worker turns stale within
one claim TTL without anyone having to notice the kill.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pydantic import SecretStr

from agent_dispatch import doctor
from agent_dispatch.k8s_names import parse_time, rfc3339
from agent_dispatch.operator._spec import DispatchSpec
from agent_dispatch.settings import Backend, Settings

ConditionStatus = Literal["True", "False", "Unknown"]

READY: Final = "Ready"
CONFIG_VALID: Final = "ConfigValid"
TRANSPORT_REACHABLE: Final = "TransportReachable"
WORKERS_AVAILABLE: Final = "WorkersAvailable"
CONDITION_TYPES: Final = (READY, CONFIG_VALID, TRANSPORT_REACHABLE, WORKERS_AVAILABLE)

# Reasons (CamelCase, as Kubernetes conditions spell them).
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_VALID: Final = "Valid"
REASON_PARTITION_DECREASE: Final = "PartitionDecreaseRefused"
REASON_RECONCILED: Final = "Reconciled"
REASON_TRANSPORT_UNREACHABLE: Final = "TransportUnreachable"
REASON_REACHABLE: Final = "Reachable"
REASON_NOT_CHECKED: Final = "NotChecked"
REASON_NO_LIVE_WORKERS: Final = "NoLiveWorkers"
REASON_WORKERS_LIVE: Final = "WorkersLive"
REASON_SCALED_TO_ZERO: Final = "ScaledToZero"
REASON_AUTOSCALER_UNAVAILABLE: Final = "AutoscalerUnavailable"
REASON_RECONCILE_FAILED: Final = "ReconcileFailed"


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Workers:
    live_ids: tuple[str, ...] = ()
    stale_ids: tuple[str, ...] = ()

    @property
    def live(self) -> int:
        return len(self.live_ids)

    @property
    def stale(self) -> int:
        return len(self.stale_ids)


def lease_is_live(lease: Mapping[str, Any], now: dt.datetime) -> bool:
    """Live while ``renewTime`` (or ``acquireTime`` before the first renewal) plus
    ``leaseDurationSeconds`` is not yet in the past. A Lease without either is stale."""
    spec = lease.get("spec") or {}
    renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds")
    if renewed is None or not isinstance(duration, int | float) or isinstance(duration, bool):
        return False
    return renewed + dt.timedelta(seconds=float(duration)) >= now


def fold_leases(leases: Iterable[Mapping[str, Any]], now: dt.datetime | None = None) -> Workers:
    """Fold worker Leases into live and stale worker ids (holderIdentity, else the Lease name)."""
    when = now or now_utc()
    live: list[str] = []
    stale: list[str] = []
    for lease in leases:
        spec = lease.get("spec") or {}
        worker = str(spec.get("holderIdentity") or (lease.get("metadata") or {}).get("name", ""))
        (live if lease_is_live(lease, when) else stale).append(worker)
    return Workers(tuple(sorted(live)), tuple(sorted(stale)))


@dataclass(frozen=True)
class Condition:
    type: str
    status: ConditionStatus
    reason: str
    message: str = ""


def merge_conditions(
    previous: Sequence[Mapping[str, Any]] | None,
    current: Iterable[Condition],
    generation: int | None,
    now: dt.datetime | None = None,
) -> list[dict[str, Any]]:
    """Conditions for ``.status.conditions``: ``lastTransitionTime`` moves only when a
    condition's status changes, as ``kubectl wait`` and humans expect."""
    when = rfc3339(now or now_utc())
    before = {str(c.get("type")): c for c in previous or []}
    merged: list[dict[str, Any]] = []
    for cond in current:
        old = before.get(cond.type)
        since = old.get("lastTransitionTime") if old and old.get("status") == cond.status else None
        item: dict[str, Any] = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": since or when,
        }
        if generation is not None:
            item["observedGeneration"] = generation
        merged.append(item)
    return merged


@dataclass(frozen=True)
class Observation:
    """What one reconcile or status refresh found. ``refused`` is a reason the operator left the
    cluster as it was (invalid spec, partition decrease); ``transport`` is None when not probed."""

    problems: tuple[str, ...] = ()
    refused_reason: str | None = None
    refused_message: str = ""
    transport_ok: bool | None = None
    transport_message: str = ""
    workers: Workers = field(default_factory=Workers)
    desired_workers: int | None = None
    autoscaler_error: str | None = None
    reconcile_error: str | None = None


def conditions(obs: Observation) -> list[Condition]:
    """Ready, ConfigValid, TransportReachable and WorkersAvailable from one observation."""
    config = (
        Condition(CONFIG_VALID, "False", REASON_INVALID_SPEC, "; ".join(obs.problems))
        if obs.problems
        else Condition(CONFIG_VALID, "True", REASON_VALID, "the spec passed the operator's validation")
    )
    if obs.transport_ok is None:
        transport = Condition(TRANSPORT_REACHABLE, "Unknown", REASON_NOT_CHECKED, obs.transport_message)
    elif obs.transport_ok:
        transport = Condition(TRANSPORT_REACHABLE, "True", REASON_REACHABLE, obs.transport_message)
    else:
        transport = Condition(
            TRANSPORT_REACHABLE, "False", REASON_TRANSPORT_UNREACHABLE, obs.transport_message
        )
    live, stale = obs.workers.live, obs.workers.stale
    counts = f"{live} live, {stale} stale" + (
        f", {obs.desired_workers} desired" if obs.desired_workers is not None else ""
    )
    if obs.desired_workers == 0:
        workers = Condition(WORKERS_AVAILABLE, "True", REASON_SCALED_TO_ZERO, counts)
    elif live > 0:
        workers = Condition(WORKERS_AVAILABLE, "True", REASON_WORKERS_LIVE, counts)
    else:
        workers = Condition(WORKERS_AVAILABLE, "False", REASON_NO_LIVE_WORKERS, counts)

    if obs.problems:
        ready = Condition(
            READY, "False", REASON_INVALID_SPEC, "invalid spec; nothing changed: " + config.message
        )
    elif obs.refused_reason is not None:
        ready = Condition(READY, "False", obs.refused_reason, obs.refused_message)
    elif obs.reconcile_error is not None:
        ready = Condition(READY, "False", REASON_RECONCILE_FAILED, obs.reconcile_error)
    elif obs.transport_ok is False:
        ready = Condition(READY, "False", REASON_TRANSPORT_UNREACHABLE, obs.transport_message)
    elif obs.autoscaler_error is not None:
        ready = Condition(READY, "False", REASON_AUTOSCALER_UNAVAILABLE, obs.autoscaler_error)
    elif workers.status != "True":
        ready = Condition(READY, "False", REASON_NO_LIVE_WORKERS, counts)
    else:
        ready = Condition(READY, "True", REASON_RECONCILED, counts)
    return [ready, config, transport, workers]


def workers_status(obs: Observation, available: int | None = None) -> dict[str, Any]:
    return {
        "desired": obs.desired_workers,
        "live": obs.workers.live,
        "stale": obs.workers.stale,
        "available": available if available is not None else obs.workers.live,
        "liveIds": list(obs.workers.live_ids),
        "staleIds": list(obs.workers.stale_ids),
    }


# --- the doctor report ---------------------------------------------------------------------------


def settings_for(spec: DispatchSpec) -> Settings:
    """The worker Settings a spec implies, without reading this process's environment (the
    operator's own variables are not the workers'). Values were validated already, so the
    constructor's validators are not needed; secrets are never read into it, only "configured"
    markers, because the doctor reports set/unset and nothing more."""
    fields: dict[str, Any] = {
        "backend_choice": Backend(spec.backend),
        "partitions": spec.partitions,
        "max_depth": spec.max_depth,
        "claim_ttl_s": float(spec.claim_ttl_s),
        "renew_interval_s": float(spec.renew_interval_s),
        "state_db_uri": SecretStr("configured") if spec.dsn_secret is not None else None,
        "signing_key": SecretStr("configured") if spec.signing_key_secret is not None else None,
    }
    if spec.sweep_interval_s is not None:
        fields["sweep_interval_s"] = float(spec.sweep_interval_s)
    if spec.max_attempts is not None:
        fields["max_attempts"] = spec.max_attempts
    if spec.kafka is not None:
        fields["kafka_topic"] = spec.kafka.topic
        fields["kafka_group"] = spec.kafka.consumer_group
        if spec.kafka.bootstrap_servers is not None:
            fields["kafka_bootstrap_servers"] = spec.kafka.bootstrap_servers
    return Settings.model_construct(**fields)


def doctor_report(spec: DispatchSpec, probes: Iterable[doctor.Probe] = ()) -> dict[str, Any]:
    """The doctor's checks for this dispatcher (including ``dispatch_lease_recovery``), redacted
    by the doctor itself: no hostnames, usernames or paths reach ``.status``."""
    checks = doctor.run(settings_for(spec), probes)
    if spec.signing_key_secret is not None:
        checks = [
            doctor.Check("signing_key", "ok", "from a Secret reference") if c.name == "signing_key" else c
            for c in checks
        ]
    return {"overall": doctor.overall(checks), "checks": [c.as_dict() for c in checks]}


def observation_probe(obs: Observation) -> doctor.Probe:
    """A doctor probe that reports what the operator observed (transport and worker heartbeats)."""

    def probe(_: Settings) -> list[doctor.Check]:
        found: list[doctor.Check] = []
        if obs.transport_ok is not None:
            found.append(
                doctor.Check(
                    "transport", "ok" if obs.transport_ok else "fail", obs.transport_message or "reachable"
                )
            )
        data = {"live": obs.workers.live, "stale": obs.workers.stale}
        if obs.workers.live > 0:
            found.append(
                doctor.Check("worker_heartbeats", "ok", f"{obs.workers.live} live worker Lease(s)", data)
            )
        elif obs.desired_workers == 0:
            found.append(doctor.Check("worker_heartbeats", "ok", "scaled to zero", data))
        else:
            found.append(doctor.Check("worker_heartbeats", "warn", "no live worker Lease", data))
        return found

    probe.__name__ = "operator_observation"
    return probe


# --- the autoscaler (mode hpa) ---------------------------------------------------------------------

#: Present only while spec.autoscaling.mode is hpa: can the HPA read agent_dispatch_queue_depth?
METRIC_AVAILABLE: Final = "MetricAvailable"
REASON_METRIC_SERVED: Final = "MetricServed"
REASON_METRIC_UNAVAILABLE: Final = "MetricUnavailable"
REASON_DEPTH_UNKNOWN: Final = "QueueDepthUnknown"


def _hpa_condition(hpa: Mapping[str, Any] | None, kind: str) -> Mapping[str, Any]:
    for cond in ((hpa or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def autoscaler_status(mode: str, hpa: Mapping[str, Any] | None) -> dict[str, Any]:
    """``.status.autoscaler`` from the HPA's own status (what ``kubectl describe`` shows): the
    operator never writes replicas itself while autoscaling is on, it only reports them."""
    st = (hpa or {}).get("status") or {}
    found: dict[str, Any] = {"mode": mode}
    for key in ("currentReplicas", "desiredReplicas", "lastScaleTime"):
        if st.get(key) is not None:
            found[key] = st[key]
    return found


def metric_condition(depth: int | None, hpa: Mapping[str, Any] | None) -> Condition:
    """False when the HPA says it cannot get the external metric (the metrics API is down, or it
    answered an error because the depth was stale), or when the depth itself is unknown: in both
    cases the HPA holds its replica count instead of scaling."""
    active = _hpa_condition(hpa, "ScalingActive")
    if active.get("status") == "False" and active.get("reason") != "ScalingDisabled":
        return Condition(
            METRIC_AVAILABLE,
            "False",
            REASON_METRIC_UNAVAILABLE,
            f"the HPA cannot read the queue depth and holds its replica count: "
            f"{active.get('reason', '')}: {str(active.get('message', ''))[:300]}",
        )
    if depth is None:
        return Condition(
            METRIC_AVAILABLE, "False", REASON_DEPTH_UNKNOWN, "the queue depth could not be observed"
        )
    return Condition(METRIC_AVAILABLE, "True", REASON_METRIC_SERVED, "the HPA reads the queue depth")
