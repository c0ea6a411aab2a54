"""Prometheus metrics of the gateway (``agent_dispatch_gateway_`` prefix, base units).

Route labels are the route templates (``/api/graph/jobs/{job_id}``), never raw paths, so the
number of series stays bounded whatever clients send.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Histogram

ADMISSION_RESULTS: Final = (
    "accepted",
    "duplicate",
    "queue_full",
    "depth_unavailable",
    "too_large",
    "invalid",
    "conflict",
    "unavailable",
)

REQUESTS = Counter(
    "agent_dispatch_gateway_requests",
    "Gateway HTTP requests by route template and status code",
    ["route", "code"],
)
ADMISSIONS = Counter("agent_dispatch_gateway_admissions", "Turn submissions by admission result", ["result"])
REQUEST_SECONDS = Histogram(
    "agent_dispatch_gateway_request_duration_seconds",
    "Gateway request latency by route template",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
SUBMIT_BATCH_SIZE = Histogram(
    "agent_dispatch_gateway_submit_batch_size",
    "Single-turn submissions admitted together in one transaction (the gateway's group commit)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 200),
)
STATUS_READ_BATCH_SIZE = Histogram(
    "agent_dispatch_gateway_status_read_batch_size",
    "Job status reads served together by one store read (the gateway's coalesced reads)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 200),
)

for _result in ADMISSION_RESULTS:
    ADMISSIONS.labels(_result)
