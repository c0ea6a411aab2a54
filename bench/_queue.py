"""PostgreSQL queue: claim latency against backlog (bench/pg_queue_bench.py's measurement) and fairness."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.postgres import PostgresTransport
from bench._common import percentile, say
from bench.pg_queue_bench import TENANTS, claim_block, interleaved, load


def _queue(dsn: str) -> PostgresTransport:
    queue = PostgresTransport(dsn, max_depth=10**9, visibility_timeout_s=300, pool_max_size=4)
    queue.ensure_ready()
    return queue


def claim_latency(fresh: Callable[[str], str], sizes: list[int], samples: int) -> dict[int, dict[str, float]]:
    """p50/p99 of one fair claim with ``size`` turns queued across 1,000 tenants (ms).

    Loading and timing are bench/pg_queue_bench.py's: real sealed envelopes admitted in batches,
    claims timed in interleaved blocks across the sizes, each claimed turn acknowledged and
    replaced outside the timing so the backlog stays put.
    """
    queues: dict[int, PostgresTransport] = {}
    out: dict[int, dict[str, float]] = {}
    try:
        for size in sizes:
            queue = _queue(fresh(f"bench_claim_{size}"))
            seconds = load(queue, size)
            say(f"claim latency: loaded {size:,} turns across {TENANTS} tenants in {seconds:.0f}s")
            queues[size] = queue
        timings = interleaved(queues, claim_block, samples)
        for size in sizes:
            got = timings[size]
            out[size] = {
                "p50_ms": percentile(got, 0.5) * 1e3,
                "p99_ms": percentile(got, 0.99) * 1e3,
                "samples": len(got),
            }
            say(
                f"claim latency at {size:>9,}: p50 {out[size]['p50_ms']:.2f} ms  p99 {out[size]['p99_ms']:.2f} ms"
            )
    finally:
        for queue in queues.values():
            queue.close()
    return out


def _turns(tenant: str, start: int, count: int) -> list[OutboundTurn]:
    # The transport never opens the envelope; the ordering under test needs only the routing keys.
    return [
        OutboundTurn(work_item_id=f"{tenant}-{i}", session_id=f"{tenant}-s{i}", tenant=tenant, wire=b"x")
        for i in range(start, start + count)
    ]


def fairness(fresh: Callable[[str], str], big: int, others: int) -> dict[str, Any]:
    """How many claims a tenant with 10 queued turns waits behind one with ``big`` queued.

    The big tenant's backlog is admitted first, then ``others`` tenants with 10 turns each, then
    the small tenant's 10. Claims are taken one at a time (and acknowledged) until the small
    tenant has been served 10 times; we count the claims before its first, and the largest gap
    between two of its claims. Goal: both at most 2 x the tenants with queued work.
    """
    queue = _queue(fresh(f"bench_fair_{others}"))
    try:
        started = time.monotonic()
        for start in range(0, big, 5000):
            queue.admit(_turns("big", start, min(5000, big - start)), bounded=False)
        for n in range(others):
            queue.admit(_turns(f"other-{n}", 0, 10), bounded=False)
        queue.admit(_turns("small", 0, 10), bounded=False)
        say(f"fairness: loaded {big:,} + {others} x 10 + 10 turns in {time.monotonic() - started:.0f}s")
        positions: list[int] = []
        claims = 0
        while len(positions) < 10:
            got = queue.claim("fairness")
            if not got:
                raise RuntimeError("the queue ran dry before the small tenant was served")
            claims += 1
            if got[0].work_item_id.startswith("small-"):
                positions.append(claims)
            queue.ack(got[0].receipt)
        gaps = [b - a for a, b in zip([0, *positions], positions, strict=False)]
        tenants = 2 + others
        return {
            "big_queued": big,
            "tenants_with_work": tenants,
            "claims_before_first": positions[0] - 1,
            "max_gap": max(gaps),
            "claims_until_small_done": positions[-1],
            "goal": 2 * tenants,
        }
    finally:
        queue.close()
