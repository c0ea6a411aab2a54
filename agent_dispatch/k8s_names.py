"""Kubernetes names (and the API server's timestamp format) shared by the worker, the operator and
the metrics API.

This module sits at the bottom of the layer stack and imports nothing from the package, so
the worker (which writes its heartbeat Lease) and the operator (which folds those Leases into
``.status``) agree on one spelling without the operator importing worker internals.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Final

#: The API group of the AgentDispatch custom resource, and the prefix of every label,
#: annotation and finalizer the project owns (never another project's prefix).
GROUP: Final = "agentdispatch.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "AgentDispatch"
PLURAL: Final = "agentdispatches"
SHORT_NAME: Final = "adx"

#: Labels on everything the operator renders, and on each worker's Lease. Label keys use a
#: DNS subdomain of their own so they cannot collide with the CRD's group in selectors.
LABEL_PREFIX: Final = "agent-dispatch.io"
INSTANCE_LABEL: Final = f"{LABEL_PREFIX}/instance"
COMPONENT_LABEL: Final = f"{LABEL_PREFIX}/component"
WORKER_COMPONENT: Final = "worker"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
NAME_LABEL: Final = "app.kubernetes.io/name"
INSTANCE_APP_LABEL: Final = "app.kubernetes.io/instance"
OPERATOR_NAME: Final = "agent-dispatch-operator"
APP_NAME: Final = "agent-dispatch"

#: Operator bookkeeping on the AgentDispatch itself (kopf's progress and diff-base storage).
ANNOTATION_PREFIX: Final = GROUP
FINALIZER: Final = f"{GROUP}/finalizer"
DIFFBASE_KEY: Final = "last-handled-configuration"
#: On rendered objects: a hash of the spec they were rendered from, so a spec change rolls pods.
SPEC_HASH_ANNOTATION: Final = f"{GROUP}/spec-hash"

#: Server-side apply field manager: the operator owns only the fields it renders.
FIELD_MANAGER: Final = OPERATOR_NAME

#: The worker Lease contract: one coordination.k8s.io/v1 Lease per worker in the AgentDispatch's
#: namespace, labelled INSTANCE_LABEL=<AgentDispatch name> and COMPONENT_LABEL=worker, with
#: spec.holderIdentity = worker id, spec.renewTime, spec.leaseDurationSeconds = claim TTL.
LEASE_API_VERSION: Final = "coordination.k8s.io/v1"

#: Environment the operator gives each worker pod besides the settings variables, so the worker
#: can name and label its Lease. Values come from the downward API where they describe the pod.
INSTANCE_ENV: Final = "AGENT_DISPATCH_INSTANCE"
NAMESPACE_ENV: Final = "AGENT_DISPATCH_NAMESPACE"
WORKER_ID_ENV: Final = "AGENT_DISPATCH_WORKER_ID"
#: The worker pod's uid (downward API): its heartbeat Lease is owned by the pod, so the garbage
#: collector removes the Lease with the pod even when the worker could not delete it itself.
POD_UID_ENV: Final = "AGENT_DISPATCH_POD_UID"

#: The worker's metrics/health port name on the pod and the Service.
METRICS_PORT_NAME: Final = "metrics"
#: The external metric an HPA scales on (served by a metrics adapter from the worker's gauge).
QUEUE_DEPTH_METRIC: Final = "agent_dispatch_queue_depth"


def worker_lease_selector(instance: str) -> str:
    """The label selector that lists one AgentDispatch's worker Leases (the instance label alone is
    the contract; the worker also sets the component label, which the operator does not require)."""
    return f"{INSTANCE_LABEL}={instance}"


def rfc3339(when: dt.datetime) -> str:
    """A timestamp as the API server writes one (``metav1.Time``: whole seconds, UTC, ``Z``)."""
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> dt.datetime | None:
    """A Kubernetes timestamp (RFC 3339, with or without fractions) or a datetime, as aware UTC;
    ``None`` for anything else (a missing or malformed field is no time, not an error)."""
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def add_namespace_scope(parser: Any, *, each: str, every: str) -> None:
    """The ``-n/--namespace`` (repeatable) and ``-A/--all-namespaces`` options, mutually exclusive,
    of every command that watches AgentDispatch objects (the operator, the metrics API): one
    spelling for both. ``each`` and ``every`` are the two options' help texts."""
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NAMESPACE", help=each)
    scope.add_argument("-A", "--all-namespaces", action="store_true", help=every)
