"""The AgentDispatch Kubernetes operator (kopf).

Public surface: the pure rendering and status functions (unit-testable without a cluster), one
reconcile pass and one status refresh (blocking, for tests and tools), and :func:`main`, the
entry point. kopf's handlers live in :mod:`agent_dispatch.operator.handlers`.
"""

from __future__ import annotations

from agent_dispatch.operator._desired import (
    Desired,
    deployment,
    desired,
    hpa,
    scaled_object,
    service,
    worker_env,
)
from agent_dispatch.operator._hooks import run_migrations
from agent_dispatch.operator._reconcile import Outcome, cleanup, reconcile, refresh
from agent_dispatch.operator._spec import DispatchSpec, parse
from agent_dispatch.operator._status import Workers, conditions, doctor_report, fold_leases
from agent_dispatch.operator._validate import Problem, validate

__all__ = [
    "Desired",
    "DispatchSpec",
    "Outcome",
    "Problem",
    "Workers",
    "cleanup",
    "conditions",
    "deployment",
    "desired",
    "doctor_report",
    "fold_leases",
    "hpa",
    "parse",
    "reconcile",
    "refresh",
    "run_migrations",
    "scaled_object",
    "service",
    "validate",
    "worker_env",
]
