"""WorkItem store benchmark on PostgreSQL: claim+commit throughput beside its raw ceiling, and
claim latency against the number of items in the store.

One run, printed with ratios:

* throughput: claim+commit cycles per second through ``PostgresStore`` and, in the same run and
  on the same server, through a bare psycopg loop that sends exactly the same statements (the
  store's own SQL text and parameters: for items without dependents the claim and the commit
  are one autocommit statement each). Rounds alternate store/raw so drift hits both.
  Goal: store >= 0.5 x raw.
* latency: p50/p99 of ``PostgresStore.claim`` (the next ready item, lease + fencing token) with
  1k, 100k and 1M ready items in the store (bulk-loaded with ``generate_series``); each claimed
  item is committed outside the timing so the backlog stays put. Goal: 1M within 1.5 x of 1k.

Usage: ``python bench/store_bench.py [--dsn postgresql://...] [--sizes 1000,100000,1000000]
[--cycles 2000] [--rounds 3] [--samples 2000]``; without ``--dsn`` it starts a throwaway server with
testenv (loopback, tuned for tests: fsync off). With ``--dsn`` it creates and drops its own
databases on that server, so the role needs CREATEDB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psycopg
from psycopg import sql

from agent_dispatch.models import Outcome
from agent_dispatch.settings import load as load_settings
from agent_dispatch.stores import postgres as pg
from agent_dispatch.stores._common import ITEM_COLUMNS
from agent_dispatch.stores.postgres import PostgresStore

BULK_LOAD = f"""
INSERT INTO {pg.T} (id, tenant, kind, queue, session_id, state, priority, attempt, max_attempts,
                    payload, payload_size, payload_digest, created_at, updated_at)
SELECT 'bench-' || %(tag)s || '-' || g, 'tenant-' || (g %% 1000), 'turn', 'default',
       'session-' || (g %% 5000), 'ready', 0, 0, 5, '\\x7b7d'::bytea, 2, '\\x00'::bytea, now(), now()
FROM generate_series(1, %(n)s) AS g
"""


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextmanager
def server(dsn: str | None) -> Iterator[Callable[[str], str]]:
    """Yields ``fresh(name) -> dsn`` of a new empty database (dropped at the end)."""
    created: list[str] = []
    if dsn is not None:
        admin = dsn

        def fresh(name: str) -> str:
            db = f"bench_{name}_{uuid.uuid4().hex[:6]}"
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
            created.append(db)
            return str(psycopg.conninfo.make_conninfo(admin, dbname=db))

        try:
            yield fresh
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                for db in created:
                    conn.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db))
                    )
        return

    from testenv.postgres import PostgresServer

    with PostgresServer() as srv:
        print(f"server: {srv.version} on loopback (testenv; fsync off)")

        def fresh_local(name: str) -> str:
            return srv.create_database(f"bench_{name}_{uuid.uuid4().hex[:6]}")

        yield fresh_local


def open_store(dsn: str) -> PostgresStore:
    settings = load_settings(claim_ttl_s=120, max_attempts=5)
    store = PostgresStore(dsn, settings, min_size=1, max_size=1)
    store.migrate()
    return store


def bulk_load(dsn: str, n: int, tag: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(BULK_LOAD, {"n": n, "tag": tag})
        conn.execute(f"VACUUM ANALYZE {pg.T}")


# --- throughput ------------------------------------------------------------------------------------------


def store_cycles(store: PostgresStore, cycles: int) -> float:
    """Seconds for ``cycles`` claim+commit cycles through the store."""
    started = time.perf_counter()
    for _ in range(cycles):
        lease = store.claim("bench-store")
        assert lease is not None
        store.commit(lease, Outcome.SUCCEEDED)
    return time.perf_counter() - started


def raw_cycles(conn: psycopg.Connection[Any], cycles: int) -> float:
    """The store's statements and parameters, without the store around them (seconds)."""
    claim_sql = pg.CLAIM_NEXT[(False, False)]
    claim_params = {"owner": "bench-raw", "ttl": 120.0, "id": None, "queue": None, "tenant": None, "off": 0.0}
    commit_params: dict[str, Any] = {
        "owner": "bench-raw",
        "state": "succeeded",
        "outcome": "succeeded",
        "error": None,
        "off": 0.0,
    }
    # Row layout of the claim: candidate, then the item columns in ITEM_COLUMNS order.
    at = {name: i + 1 for i, name in enumerate(ITEM_COLUMNS)}
    i_id, i_tenant, i_epoch, i_token = at["id"], at["tenant"], at["lease_epoch"], at["fencing_token"]
    started = time.perf_counter()
    for _ in range(cycles):
        # Both are single autocommit statements, as the store sends them for items without dependents.
        rec = conn.execute(claim_sql, claim_params).fetchone()
        assert rec is not None and rec[i_id] is not None
        commit_params.update(id=rec[i_id], tenant=rec[i_tenant], epoch=rec[i_epoch], token=rec[i_token])
        done = conn.execute(pg.COMMIT_FAST, commit_params).fetchone()
        assert done is not None
    return time.perf_counter() - started


def throughput(fresh: Callable[[str], str], cycles: int, rounds: int, block: int) -> None:
    """Store and raw alternate in small blocks, so a busy machine slows both alike."""
    dsn = fresh("throughput")
    store = open_store(dsn)
    bulk_load(dsn, (cycles + 100) * rounds * 2 + 1000, "t")
    raw = psycopg.connect(dsn, autocommit=True)
    store_cycles(store, 100)  # warm both: prepared statements, caches
    raw_cycles(raw, 100)
    store_rates, raw_rates = [], []
    for _ in range(rounds):
        store_s = raw_s = 0.0
        for _ in range(cycles // block):
            store_s += store_cycles(store, block)
            raw_s += raw_cycles(raw, block)
        store_rates.append(cycles / store_s)
        raw_rates.append(cycles / raw_s)
    raw.close()
    store.close()
    s, r = statistics.median(store_rates), statistics.median(raw_rates)
    print(
        f"\nclaim+commit cycles/s (one connection; {rounds} rounds of {cycles}, store/raw alternating every {block}):"
    )
    print(f"  store  {s:8.0f}   rounds: {', '.join(f'{x:.0f}' for x in store_rates)}")
    print(f"  raw    {r:8.0f}   rounds: {', '.join(f'{x:.0f}' for x in raw_rates)}")
    print(f"  store/raw = {s / r:.2f}  (goal >= 0.50)")


# --- claim latency against size -------------------------------------------------------------------------


def claim_latency(fresh: Callable[[str], str], sizes: list[int], samples: int) -> dict[int, list[float]]:
    """Claim timings per size, sampled round-robin across the sizes so drift hits all of them."""
    stores = {}
    for size in sizes:
        started = time.monotonic()
        dsn = fresh(f"latency_{size}")
        stores[size] = open_store(dsn)
        bulk_load(dsn, size + samples + 200, "l")
        print(f"  loaded {size:>9,} items in {time.monotonic() - started:.0f}s")
    for store in stores.values():
        for _ in range(200):  # warm-up: prepared statements, index pages
            lease = store.claim("bench")
            assert lease is not None
            store.commit(lease, Outcome.SUCCEEDED)
    timings: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(samples):
        for size, store in stores.items():
            started = time.perf_counter()
            lease = store.claim("bench")
            timings[size].append(time.perf_counter() - started)
            assert lease is not None
            store.commit(lease, Outcome.SUCCEEDED)
    for store in stores.values():
        store.close()
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dsn", help="an existing server (default: start one with testenv)")
    parser.add_argument("--sizes", default="1000,100000,1000000", help="items in the store for latency")
    parser.add_argument("--cycles", type=int, default=3000, help="claim+commit cycles per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", type=int, default=100, help="cycles per store/raw alternation")
    parser.add_argument("--samples", type=int, default=3000, help="timed claims per size")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]

    with server(args.dsn) as fresh:
        throughput(fresh, args.cycles, args.rounds, args.block)
        print(
            f"\nclaim latency, ms ({args.samples} claims per size, round-robin, each then committed untimed):"
        )
        timings = claim_latency(fresh, sizes, args.samples)
        results = {
            size: (percentile(t, 0.50) * 1000, percentile(t, 0.99) * 1000) for size, t in timings.items()
        }
        for size, (p50, p99) in results.items():
            print(f"  {size:>9,} items  p50 {p50:6.3f}  p99 {p99:6.3f}")
        base = results[sizes[0]]
        for size in sizes[1:]:
            p50, p99 = results[size]
            print(
                f"  {size:,} vs {sizes[0]:,}: p50 x{p50 / base[0]:.2f}, p99 x{p99 / base[1]:.2f}  (goal <= 1.5)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
