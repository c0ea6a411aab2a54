"""PostgreSQL queue benchmark: claim latency against backlog size, admission cost against depth.

One run, printed as ratios:

* claim: p50/p99 of ``PostgresTransport.claim`` (one turn, fair order) with 1k, 100k and 1M
  turns queued across 1,000 tenants (goal: 1M within 1.5x of 1k). Each claimed turn is
  acknowledged (outside the timing), so the backlog stays put while history and lanes churn.
* admission: p50/p99 of ``admit`` of one turn at depth 0 and at depth 100k (goal: equal within
  noise: compare-and-admit is one counter row, never ``COUNT(*)``).
* ``--explain``: EXPLAIN (ANALYZE, BUFFERS) of each statement the claim runs, at the largest size.

Backlogs are loaded through ``admit`` itself (batches of 5,000), with real sealed envelopes.

Usage: ``python bench/pg_queue_bench.py [--dsn postgresql://...] [--sizes 1000,100000,1000000]``;
without ``--dsn`` it starts a throwaway server with testenv (loopback, tuned for tests).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psycopg
from psycopg import sql

from agent_dispatch.envelope import AgentTurnEnvelope, seal
from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.postgres import PostgresTransport

KEY = b"bench-signing-key-0123456789abcdef0123"
TENANTS = 1000
LOAD_BATCH = 5000


def make_turns(start: int, count: int) -> list[OutboundTurn]:
    now = time.time()
    out = []
    for i in range(start, start + count):
        tenant = f"tenant-{i % TENANTS}"
        job = f"job-{i}-{uuid.uuid4().hex[:6]}"
        env = AgentTurnEnvelope(
            job_id=job,
            session_id=f"session-{i % 5000}",
            kind="agent.turn",
            payload_ref=job,
            tenant=tenant,
            priority=i % 3,
            enqueued_at=now,
        )
        out.append(
            OutboundTurn(
                work_item_id=job,
                session_id=env.session_id,
                tenant=tenant,
                wire=seal(env, KEY),
                priority=env.priority,
                fairness_group=f"group-{i % 4}",
            )
        )
    return out


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextmanager
def server(dsn: str | None) -> Iterator[Callable[[str], str]]:
    """Yields ``fresh(name) -> dsn``: a new empty database per measurement."""
    if dsn is not None:
        base = dsn

        def fresh(name: str) -> str:
            with psycopg.connect(base, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            return psycopg.conninfo.make_conninfo(base, dbname=name)

        yield fresh
        return
    from testenv.postgres import PostgresServer

    with PostgresServer() as pg:
        print(f"# server: {pg.version} (throwaway, loopback, fsync off)")
        yield pg.create_database


def load(queue: PostgresTransport, count: int) -> float:
    started = time.perf_counter()
    for start in range(0, count, LOAD_BATCH):
        queue.admit(make_turns(start, min(LOAD_BATCH, count - start)), bounded=False)
    with psycopg.connect(queue.dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    return time.perf_counter() - started


def claim_block(queue: PostgresTransport, count: int, serial: Iterator[int]) -> list[float]:
    """Timed claims; each claimed turn is acknowledged and replaced (untimed): the backlog stays put."""
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        got = queue.claim("bench-worker")
        samples.append(time.perf_counter() - started)
        if not got:
            raise SystemExit("the backlog ran dry")
        queue.ack(got[0].receipt)
        queue.admit(make_turns(next(serial), 1), bounded=False)
    return samples


def admit_block(queue: PostgresTransport, count: int, serial: Iterator[int]) -> list[float]:
    """Timed single-turn admissions; each is followed (untimed) by one claim+ack: the depth stays put."""
    samples = []
    for _ in range(count):
        turn = make_turns(next(serial), 1)
        started = time.perf_counter()
        queue.admit(turn)
        samples.append(time.perf_counter() - started)
        (delivery,) = queue.claim("bench-worker")
        queue.ack(delivery.receipt)
    return samples


def interleaved(
    queues: dict[int, PostgresTransport],
    block: Callable[[PostgresTransport, int, Iterator[int]], list[float]],
    rounds: int,
    block_size: int = 100,
) -> dict[int, list[float]]:
    """Blocks of calls, alternating between the queues: a busy machine's drift hits every size alike.

    The first block of each queue is a warm-up and is not kept.
    """
    serial = itertools.count(100_000_000)
    samples: dict[int, list[float]] = {size: [] for size in queues}
    for round_no in range(rounds // block_size + 1):
        for size, queue in queues.items():
            got = block(queue, block_size, serial)
            if round_no:
                samples[size] += got
    return samples


def throughput(queue: PostgresTransport, threads: int, seconds: float) -> float:
    """Steady-state turns/s with ``threads`` workers each claiming 8, acking them, admitting 8 more."""
    stop = time.monotonic() + seconds
    counts = [0] * threads

    def work(n: int) -> None:
        while time.monotonic() < stop:
            got = queue.claim(f"bench-{n}", max_items=8)
            if not got:
                return
            queue.ack_many([d.receipt for d in got])
            queue.admit(make_turns(30_000_000 + n * 1_000_000 + counts[n], len(got)), bounded=False)
            counts[n] += len(got)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - started)


_PICK = """
        SELECT p.tenant_ref, p.priority, p.lane_served, p.served, gl.group_ref, gl.group_served, gl.served, r.id
          FROM (SELECT l.tenant_ref, l.priority, l.tenant_served AS lane_served, t.served
                  FROM agent_dispatch_queue_tenant_lane l
                  JOIN agent_dispatch_queue_tenant t ON t.tenant_ref = l.tenant_ref
                 WHERE l.ready > 0
                 ORDER BY l.priority DESC, l.tenant_served
                 LIMIT %(n)s
                   FOR UPDATE OF t SKIP LOCKED) p
          LEFT JOIN LATERAL (
                SELECT x.group_ref, x.group_served, g.served FROM agent_dispatch_queue_group_lane x
                  LEFT JOIN agent_dispatch_queue_group g ON g.tenant_ref = x.tenant_ref AND g.group_ref = x.group_ref
                 WHERE x.tenant_ref = p.tenant_ref AND x.priority = p.priority AND x.ready > 0
                 ORDER BY x.group_served LIMIT 1) gl ON true
          LEFT JOIN LATERAL (
                SELECT q.id FROM agent_dispatch_queue q
                 WHERE q.tenant_ref = p.tenant_ref AND q.group_ref = gl.group_ref
                   AND q.priority = p.priority AND q.state = 'r'
                 ORDER BY q.deadline, q.enqueued_at, q.id LIMIT 1) r ON true"""

#: The reads of ``agent_dispatch_queue_claim`` (``transports/postgres/sql/queue.sql``), as it runs them.
EXPLAINED = {
    "wake-up probe (first entry of the wake-up index)": """
        SELECT q.visible_at FROM agent_dispatch_queue q WHERE q.state <> 'r' ORDER BY q.visible_at LIMIT 1""",
    "expired-deadline probe (first entry of the expiry index)": """
        SELECT q.deadline FROM agent_dispatch_queue q
         WHERE q.state = 'r' AND q.deadline IS NOT NULL ORDER BY q.deadline LIMIT 1""",
    "first round of a claim of 16: 16 lanes with their tenants locked, groups, first rows": _PICK,
    "one more row: the best lane, its tenant locked, its group, its first row": _PICK,
}
_EXPLAIN_LIMITS = {title: 16 if "16" in title else 1 for title in EXPLAINED}


def explain(queue: PostgresTransport) -> None:
    with psycopg.connect(
        queue.dsn
    ) as conn:  # one transaction, rolled back: explaining locks nothing for good
        for title, statement in EXPLAINED.items():
            print(f"\n## EXPLAIN ANALYZE: {title}")
            rows = conn.execute(
                f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {statement}",
                {"n": _EXPLAIN_LIMITS[title]},
            ).fetchall()
            for (line,) in rows:
                print(f"    {line}")
        conn.rollback()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dsn", help="a PostgreSQL server to create scratch databases on (default: start one)"
    )
    parser.add_argument("--sizes", default="1000,100000,1000000", help="queued turns per claim measurement")
    parser.add_argument("--rounds", type=int, default=2000, help="timed claims (and admits) per size")
    parser.add_argument(
        "--admit-depth", type=int, default=100_000, help="the deep queue for the admission test"
    )
    parser.add_argument("--threads", type=int, default=4, help="workers for the throughput figure (0: skip)")
    parser.add_argument("--explain", action="store_true", help="print EXPLAIN ANALYZE at the largest size")
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",") if s})
    small, large = sizes[0], sizes[-1]

    with server(args.dsn) as fresh:
        claim_queues: dict[int, PostgresTransport] = {}
        for size in sizes:
            queue = PostgresTransport(
                fresh(f"bench_claim_{size}"), max_depth=10**9, visibility_timeout_s=300, pool_max_size=16
            )
            queue.ensure_ready()
            print(
                f"# loaded {size:>9,} turns across {TENANTS} tenants in {load(queue, size):5.1f} s",
                flush=True,
            )
            claim_queues[size] = queue
        claims = interleaved(claim_queues, claim_block, args.rounds)
        for size, queue in claim_queues.items():
            rate = throughput(queue, args.threads, 3.0) if args.threads else 0.0
            print(
                f"claim  {size:>9,} queued: p50 {percentile(claims[size], 0.5) * 1e3:6.3f} ms"
                f"  p99 {percentile(claims[size], 0.99) * 1e3:6.3f} ms"
                f"  ({args.threads} workers: {rate:,.0f} claim+ack+admit/s)",
                flush=True,
            )
        if args.explain:
            explain(claim_queues[large])
        for queue in claim_queues.values():
            queue.close()

        depths = sorted({0, args.admit_depth})
        admit_queues: dict[int, PostgresTransport] = {}
        for depth in depths:
            queue = PostgresTransport(
                fresh(f"bench_admit_{depth}"), max_depth=10**9, visibility_timeout_s=300, pool_max_size=4
            )
            queue.ensure_ready()
            load(queue, depth)
            admit_queues[depth] = queue
        admits = interleaved(admit_queues, admit_block, args.rounds)
        for depth, queue in admit_queues.items():
            print(
                f"admit  at depth {depth:>9,}: p50 {percentile(admits[depth], 0.5) * 1e3:6.3f} ms"
                f"  p99 {percentile(admits[depth], 0.99) * 1e3:6.3f} ms",
                flush=True,
            )
            queue.close()

    print("\n# ratios (goal: claim <= 1.5x; admission ~1.0x)")
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        ratio = percentile(claims[large], q) / percentile(claims[small], q)
        print(f"claim {name}  {large:,} vs {small:,} queued: {ratio:4.2f}x")
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        ratio = percentile(admits[depths[-1]], q) / percentile(admits[depths[0]], q)
        print(f"admit {name}  depth {depths[-1]:,} vs {depths[0]:,}: {ratio:4.2f}x")
    print(f"({args.rounds} timed calls per size, in interleaved blocks of 100 after a warm-up block)")


if __name__ == "__main__":
    main()
