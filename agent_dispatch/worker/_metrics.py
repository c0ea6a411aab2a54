"""Prometheus metrics of the worker (``agent_dispatch_`` prefix, base units)."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

OUTCOMES: Final = (
    "succeeded",
    "failed",
    "cancelled",
    "expired",
    "fenced",
    "poison",
    "dead_letter",
    "retried",
)

HEARTBEAT = Gauge(
    "agent_dispatch_worker_heartbeat_timestamp_seconds", "Unix time of the worker's last loop iteration"
)
# No queue-depth gauge here: every worker exporting the global depth made one series per pod, which
# an adapter summing over pods multiplies. The metrics API exports one series per AgentDispatch.
TURNS = Counter("agent_dispatch_turns", "Turns handled by outcome", ["outcome"])
IN_FLIGHT = Gauge("agent_dispatch_turns_in_flight", "Turns executing now")
LEASE_RENEWALS = Counter("agent_dispatch_lease_renewals", "Successful WorkItem lease renewals")
LEASE_FAILURES = Counter("agent_dispatch_lease_failures", "Leases lost while running, by reason", ["reason"])
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
CLAIM_SECONDS = Histogram(
    "agent_dispatch_claim_duration_seconds", "Delivery + lease claim latency", buckets=_BUCKETS
)
EXECUTE_SECONDS = Histogram("agent_dispatch_execute_duration_seconds", "Executor run time", buckets=_BUCKETS)
COMMIT_SECONDS = Histogram(
    "agent_dispatch_commit_duration_seconds", "Fenced commit + ack latency", buckets=_BUCKETS
)

for _outcome in OUTCOMES:
    TURNS.labels(_outcome)
for _reason in ("fenced", "expired", "cancelled"):
    LEASE_FAILURES.labels(_reason)
