"""The web UI's overview and tenants page at scale: ``python -m bench.ui_bench [--items N] [--tenants T]``.

Goal (issue 23): the overview answers in under 100 ms with 1,000,000 queued turns across 1,000
tenants on PostgreSQL, with no full-table scan per request; the tenants page costs the page's
size, not the queue's.

What runs: a PostgreSQL server from testenv (loopback; or ``--dsn``), one database migrated by the
store (WorkItem schema and its per-tenant counters) and the PostgreSQL transport. ``--items`` ready
WorkItems spread round-robin over ``--tenants`` tenants are loaded in SQL (``generate_series``),
each with its ``submit`` outcome record and its delivery admitted through the transport's own
``agent_dispatch_queue_admit`` function, so the depth counter, per-tenant queue counters and
fairness lanes are exactly what the transport keeps; the store's counters move through their
triggers. Then ``agent-dispatch gateway`` serves the UI, an administrator signs in, and the JSON
behind each page (``/ui/api/overview``, ``/ui/api/tenants``: the same view model the HTML page
renders) is timed from a client on the same machine, over one kept-alive connection.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

import psycopg

from bench._common import median, percentile, python_cmd, say, spawn
from bench._e2e import Databases, OursDriver

CHUNK = 100_000
SESSIONS = 5000

LOAD_ITEMS = f"""
INSERT INTO agent_dispatch_work_items (id, tenant, kind, queue, session_id, state, priority, attempt,
       max_attempts, payload, payload_size, payload_digest, created_at, updated_at, last_dispatched_at)
SELECT 'ui-bench-' || g, 'tenant-' || lpad((g %% %(tenants)s::bigint)::text, 4, '0'), 'turn', 'default',
       'session-' || (g %% {SESSIONS}), 'ready', 0, 0, 3, '\\x7b7d'::bytea, 2, '\\x00'::bytea,
       now() - interval '1 hour' + g * interval '1 ms', now(), now()
  FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g
"""

LOAD_OUTCOMES = """
INSERT INTO agent_dispatch_outcomes (work_item_id, tenant, event, owner, lease_epoch, fencing_token, at)
SELECT 'ui-bench-' || g, 'tenant-' || lpad((g %% %(tenants)s::bigint)::text, 4, '0'), 'submit', NULL, 0, 0, now()
  FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g
"""

# The transport's own admission (unbounded, as a re-drive): its counters stay exact.
LOAD_QUEUE = f"""
SELECT agent_dispatch_queue_admit(
    array_agg('ui-bench-' || g ORDER BY g), array_agg('session-' || (g %% {SESSIONS}) ORDER BY g),
    array_agg((%(trefs)s::bytea[])[1 + g %% %(tenants)s::bigint] ORDER BY g),
    array_agg((%(grefs)s::bytea[])[1 + g %% %(tenants)s::bigint] ORDER BY g),
    array_agg(0 ORDER BY g), array_agg(NULL::timestamptz ORDER BY g), array_agg(NULL::timestamptz ORDER BY g),
    array_agg('\\x00'::bytea ORDER BY g), NULL)
  FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g
"""


# The store's O(1) count of unfinished items (schema v2, where present) is a row trigger on one
# row: fine per submit batch, quadratic over a 100,000-row statement (each update of the row in
# one transaction walks the versions before it). The load moves it once per chunk instead, in
# the chunk's transaction, so it stays exact.
BUMP_UNFINISHED = "UPDATE agent_dispatch_unfinished SET n = n + %(n)s"


def _unfinished_trigger(conn: psycopg.Connection[Any], *, enable: bool) -> bool:
    found = conn.execute(
        "SELECT 1 FROM pg_trigger WHERE tgname = 'agent_dispatch_unfinished_insert'"
        " AND tgrelid = 'agent_dispatch_work_items'::regclass"
    ).fetchone()
    if found:
        action = "ENABLE" if enable else "DISABLE"
        conn.execute(
            f"ALTER TABLE agent_dispatch_work_items {action} TRIGGER agent_dispatch_unfinished_insert"
        )
    return found is not None


def tenant_name(i: int) -> str:
    return f"tenant-{i:04d}"


def load(driver: OursDriver, items: int, tenants: int) -> dict[str, float]:
    from agent_dispatch.transports import open_transport

    settings = driver._settings()
    transport = open_transport(settings)
    try:
        transport.depth()  # creates the queue's schema and its ref key
        names = [tenant_name(i) for i in range(tenants)]
        trefs = [transport.tenant_ref(n) for n in names]  # type: ignore[attr-defined]
        grefs = [transport.group_ref(n, None) for n in names]  # type: ignore[attr-defined]
    finally:
        transport.close()
    timings: dict[str, float] = {}
    dsn = driver.env["STATE_DB_URI"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name, statement, extra in (
            ("items", LOAD_ITEMS, {}),
            ("outcomes", LOAD_OUTCOMES, {}),
            ("queue", LOAD_QUEUE, {"trefs": trefs, "grefs": grefs}),
        ):
            started = time.monotonic()
            for first in range(1, items + 1, CHUNK):
                params = {"first": first, "last": min(first + CHUNK - 1, items), "tenants": tenants, **extra}
                with conn.transaction():
                    unfinished = name == "items" and _unfinished_trigger(conn, enable=False)
                    conn.execute(statement, params)
                    if unfinished:
                        conn.execute(BUMP_UNFINISHED, {"n": params["last"] - first + 1})
                        _unfinished_trigger(conn, enable=True)
            timings[name] = time.monotonic() - started
            say(f"loaded {items:,} {name} in {timings[name]:.0f}s")
        started = time.monotonic()
        conn.execute("VACUUM ANALYZE")
        timings["vacuum"] = time.monotonic() - started
        depth = conn.execute("SELECT depth FROM agent_dispatch_queue_depth").fetchone()
        assert depth is not None and depth[0] == items, f"queue depth counter {depth} != {items}"
    return timings


#: The tenants page's read before the per-tenant counters (PostgreSQL's ``backlog`` statement, now
#: gone): every unfinished row grouped by tenant. Timed beside the pages for comparison.
GROUPED_BACKLOG = """
SELECT tenant,
       count(*) FILTER (WHERE state IN ('submitted', 'ready')) AS queued,
       count(*) FILTER (WHERE state IN ('leased', 'running')) AS running,
       min(created_at) FILTER (WHERE state IN ('submitted', 'ready')) AS oldest
FROM agent_dispatch_work_items
WHERE state IN ('submitted', 'ready', 'leased', 'running')
GROUP BY tenant ORDER BY queued DESC, tenant LIMIT 1000
"""


def grouped_backlog_ms(driver: OursDriver, runs: int = 5) -> float:
    """The previous tenants page's read, for comparison: the median of ``runs``, in ms."""
    with psycopg.connect(driver.env["STATE_DB_URI"], autocommit=True) as conn:
        conn.execute(GROUPED_BACKLOG).fetchall()  # warm
        timings = []
        for _ in range(runs):
            started = time.perf_counter()
            conn.execute(GROUPED_BACKLOG).fetchall()
            timings.append((time.perf_counter() - started) * 1000)
    say(f"the previous tenants read (GROUP BY over the unfinished rows): {median(timings):.0f} ms")
    return round(median(timings), 1)


class Client:
    """One kept-alive connection with the UI's session cookie."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)
        self.cookie = ""

    def login(self, token: str) -> None:
        body = urllib.parse.urlencode({"token": token})
        self.conn.request("POST", "/ui/login", body, {"Content-Type": "application/x-www-form-urlencoded"})
        response = self.conn.getresponse()
        response.read()
        assert response.status == 303, f"sign-in answered {response.status}"
        cookie = response.getheader("Set-Cookie") or ""
        self.cookie = cookie.split(";", 1)[0]

    def get(self, path: str) -> tuple[float, dict[str, Any]]:
        started = time.perf_counter()
        self.conn.request("GET", path, headers={"Cookie": self.cookie, "Accept": "application/json"})
        response = self.conn.getresponse()
        body = response.read()
        elapsed = time.perf_counter() - started
        assert response.status == 200, f"{path} answered {response.status}: {body[:200]!r}"
        return elapsed, json.loads(body)


def measure(client: Client, path: str, samples: int) -> dict[str, Any]:
    for _ in range(20):  # warm: prepared statements, caches, the pool
        client.get(path)
    timings = []
    model: dict[str, Any] = {}
    for _ in range(samples):
        elapsed, model = client.get(path)
        timings.append(elapsed * 1000)
    result = {
        "path": path,
        "samples": samples,
        "p50_ms": round(percentile(timings, 0.50), 2),
        "p99_ms": round(percentile(timings, 0.99), 2),
        "median_ms": round(median(timings), 2),
        "max_ms": round(max(timings), 2),
    }
    say(f"{path}: p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms ({samples} requests)")
    result["model_fields"] = model.get("fields", {})
    return result


def run(server: Any, items: int, tenants: int, samples: int, log_dir: Path) -> dict[str, Any]:
    from agent_dispatch.gateway import hash_token, new_token, write_tokens_file

    driver = OursDriver("postgres", Databases(server))
    driver.prepare()
    try:
        timings = load(driver, items, tenants)
        scan_ms = grouped_backlog_ms(driver)
        admin, own = new_token(), new_token()
        tokens = Path(tempfile.mkdtemp(prefix="agent-dispatch-bench-")) / "tokens.yaml"
        write_tokens_file(tokens, {tenant_name(1): [hash_token(own)]}, admins={"ops": [hash_token(admin)]})
        gateway = spawn(
            "ui-gateway",
            python_cmd("-m", "agent_dispatch.cli", "gateway", "--port", "0"),
            env={
                **driver.env,
                "AGENT_DISPATCH_TOKENS_FILE": str(tokens),
                "AGENT_DISPATCH_METRICS_PORT": "0",
                "AGENT_DISPATCH_MAX_DEPTH": str(max(items * 2, 10)),
            },
            log_dir=log_dir,
        )
        try:
            url = gateway.wait_line("agent-dispatch gateway: serving on", 120).rsplit(" ", 1)[1]
            time.sleep(5)  # a few samples: the sampler folds the counters' load-time deltas
            ops = Client(url)
            ops.login(admin)
            tenant = Client(url)
            tenant.login(own)
            results = {
                "overview (admin)": measure(ops, "/ui/api/overview", samples),
                "tenants, first page (admin)": measure(ops, "/ui/api/tenants", samples),
                "tenants, middle page (admin)": measure(
                    ops, f"/ui/api/tenants?after={tenant_name(tenants // 2)}", samples
                ),
                "overview (tenant)": measure(tenant, "/ui/api/overview", samples),
                "tenants (tenant: its own row)": measure(tenant, "/ui/api/tenants", samples),
            }
            _, page = ops.get("/ui/api/tenants")
            rows = page["tables"]["tenants"]
            expected = str(f"{items // tenants:,}")
            assert rows and all(r[1] in (expected, f"{items // tenants + 1:,}") for r in rows), rows[:3]
        finally:
            gateway.stop()
    finally:
        driver.cleanup()
    return {
        "items": items,
        "tenants": tenants,
        "load_s": timings,
        "pages": results,
        "grouped_backlog_ms": scan_ms,
    }


COUNT_TRIGGERS = ("agent_dispatch_tenant_count_insert", "agent_dispatch_tenant_count_update")


def trigger_cost(server: Any, cycles: int, rounds: int, block: int = 100, batch: int = 1) -> dict[str, Any]:
    """What the per-tenant counters add to the hot path: submit + claim + commit cycles through
    the store with their triggers enabled and disabled, alternating blocks on one database. With
    ``batch`` > 1, the worker's batched path: ``batch`` items per batch submit, ``start_many`` and
    ``commit_many`` (a cycle is still one item)."""
    from agent_dispatch.models import Outcome, SubmitRequest

    driver = OursDriver("postgres", Databases(server))
    driver.prepare()
    from agent_dispatch.stores.postgres import PostgresStore

    dsn = driver.env["STATE_DB_URI"]
    store = PostgresStore(dsn, driver._settings(), min_size=1, max_size=1)
    toggle = psycopg.connect(dsn, autocommit=True)

    def cycle_block(n: int, tenant: str) -> float:
        started = time.perf_counter()
        if batch > 1:
            for _ in range(n // batch):
                requests = [SubmitRequest(tenant=tenant, kind="turn", payload=b"{}") for _ in range(batch)]
                made = store.submit_many_in_transaction(requests, lambda conn, items: None)
                ids = [r.item.id for r in made if not isinstance(r, Exception)]
                started_turns = store.start_many("bench", [(i, tenant) for i in ids])
                store.commit_many([(t.lease, Outcome.SUCCEEDED, None) for t in started_turns.values()])
            return time.perf_counter() - started
        for _ in range(n):
            item = store.submit(SubmitRequest(tenant=tenant, kind="turn", payload=b"{}")).item
            lease = store.claim("bench", work_item_id=item.id)
            assert lease is not None
            store.commit(lease, Outcome.SUCCEEDED)
        return time.perf_counter() - started

    def triggers(enable: bool) -> None:
        for name in COUNT_TRIGGERS:
            action = "ENABLE" if enable else "DISABLE"
            toggle.execute(f"ALTER TABLE agent_dispatch_work_items {action} TRIGGER {name}")

    try:
        cycle_block(block, "warm")
        on, off = [], []
        for r in range(rounds):
            t_on = t_off = 0.0
            for b in range(cycles // block):
                triggers(False)
                t_off += cycle_block(block, f"t{r}-{b % 10}")
                triggers(True)
                t_on += cycle_block(block, f"t{r}-{b % 10}")
            on.append(t_on / cycles * 1e6)
            off.append(t_off / cycles * 1e6)
    finally:
        toggle.close()
        store.close()
        driver.cleanup()
    result = {
        "cycles": cycles,
        "rounds": rounds,
        "batch": batch,
        "with_counters_us": round(median(on), 1),
        "without_counters_us": round(median(off), 1),
        "runs_on_us": [round(x, 1) for x in on],
        "runs_off_us": [round(x, 1) for x in off],
    }
    say(
        f"submit+claim+commit per cycle: {result['with_counters_us']:.0f} us with the per-tenant counters, "
        f"{result['without_counters_us']:.0f} us without (batches of {batch}; medians of {rounds} rounds of {cycles})"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=300, help="timed requests per page")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--trigger-cost",
        type=int,
        metavar="CYCLES",
        default=0,
        help="also time the counters' triggers on the hot path",
    )
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="agent-dispatch-ui-bench-"))
    from testenv.postgres import PostgresServer

    with PostgresServer() as srv:
        say(f"server: {srv.version} on loopback (testenv); logs in {log_dir}")
        result = run(srv, args.items, args.tenants, args.samples, log_dir) if args.items else {"pages": {}}
        if args.trigger_cost:
            result["trigger_cost"] = trigger_cost(srv, args.trigger_cost, rounds=3)
            result["trigger_cost_batched"] = trigger_cost(
                srv, args.trigger_cost, rounds=3, block=160, batch=16
            )
    if "grouped_backlog_ms" in result:
        print(f"previous tenants read (GROUP BY over unfinished rows): {result['grouped_backlog_ms']:.0f} ms")
    for name, r in result["pages"].items():
        goal = "  (goal < 100 ms)" if name.startswith("overview") else ""
        print(f"{name:32s} p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms{goal}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
