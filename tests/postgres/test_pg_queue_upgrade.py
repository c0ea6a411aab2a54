"""An existing version-1 PostgreSQL queue is upgraded in place by ``ensure_ready``, nothing lost.

The old queue is built from the version-1 DDL verbatim (``queue_schema_v1.sql``) and filled through
its own functions: ready, delayed, claimed and acknowledged turns across tenants and groups.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from agent_dispatch.errors import SchemaOutdated
from agent_dispatch.transport import OutboundTurn, Receipt
from agent_dispatch.transports.postgres import PostgresTransport, _Claim
from agent_dispatch.transports.postgres import schema as _pg_schema

pytestmark = pytest.mark.postgres

V1_DDL = (Path(__file__).parent / "queue_schema_v1.sql").read_text()


def ref(salt: bytes, *parts: str) -> bytes:
    # The transport's derivation without a signing key (PostgresTransport._ref), so that turns
    # admitted after the upgrade join the history of the same tenants.
    return hmac.new(salt, b"\x00".join(p.encode() for p in parts), hashlib.sha256).digest()[:16]


def build_v1_queue(dsn: str) -> tuple[bytes, dict[str, tuple[int, uuid.UUID, datetime]]]:
    """A version-1 queue as the old code left it; returns the salt and the live claims by work item."""
    salt = secrets.token_bytes(32)
    turns = [  # work item, tenant, group, priority, delayed
        ("a1", "tenant-a", "g1", 0, False),
        ("a2", "tenant-a", "g1", 0, False),
        ("a3", "tenant-a", "g2", 5, False),
        ("a4", "tenant-a", "g2", 0, True),
        ("b1", "tenant-b", "", 0, False),
        ("b2", "tenant-b", "", 0, False),
        ("c1", "tenant-c", "", 0, False),
    ]
    later = datetime.now(UTC) + timedelta(hours=1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE agent_dispatch_queue_meta (key text PRIMARY KEY, value bytea NOT NULL)")
        conn.execute(
            "INSERT INTO agent_dispatch_queue_meta VALUES ('schema_version', '1'), ('ref_salt', %s)", (salt,)
        )
        conn.execute(V1_DDL)
        conn.execute(
            "SELECT agent_dispatch_queue_admit(%s::text[], %s::text[], %s::bytea[], %s::bytea[], %s::integer[], "
            "%s::timestamptz[], %s::timestamptz[], %s::bytea[], NULL)",
            (
                [t[0] for t in turns],
                [f"s-{t[0]}" for t in turns],
                [ref(salt, "tenant", t[1]) for t in turns],
                [ref(salt, "group", t[1], t[2]) for t in turns],
                [t[3] for t in turns],
                [None] * len(turns),
                [later if t[4] else None for t in turns],
                [t[0].encode() for t in turns],
            ),
        )
        # Claim three (a3 first: priority 5; newcomers of one batch in tenant_ref order), acknowledge
        # one of them (which empties tenant-c).
        claimed = conn.execute(
            "SELECT id, work_item_id, claim_token, claimed_at "
            "FROM agent_dispatch_queue_claim('old-worker', 3, interval '5 minutes')"
        ).fetchall()
        assert claimed[0][1] == "a3" and {r[1] for r in claimed} == {"a3", "b1", "c1"}
        live = {r[1]: (r[0], r[2], r[3]) for r in claimed}
        row_id, token, at = live.pop("c1")
        acked = conn.execute(
            "SELECT agent_dispatch_queue_ack(%s::bigint[], %s::text[], %s::uuid[], %s::timestamptz[])",
            ([row_id], ["old-worker"], [token], [at]),
        ).fetchall()
        assert acked == [(row_id,)]
        assert conn.execute("SELECT count(*) FROM agent_dispatch_queue_tenant").fetchone() == (2,)
    return salt, live


def test_a_version_1_queue_is_upgraded_in_place(postgres_dsn: str) -> None:
    salt, live = build_v1_queue(postgres_dsn)

    queue = PostgresTransport(postgres_dsn, max_depth=100, visibility_timeout_s=300)
    queue.ensure_ready()
    try:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            assert conn.execute(
                "SELECT value FROM agent_dispatch_queue_meta WHERE key = 'schema_version'"
            ).fetchone() == (str(_pg_schema.SCHEMA_VERSION).encode(),)
            assert conn.execute(
                "SELECT value FROM agent_dispatch_queue_meta WHERE key = 'ref_salt'"
            ).fetchone() == (salt,)
            # The counters are the queue's rows per (tenant, group); the history lost its copies.
            counts = conn.execute(
                "SELECT tenant_ref, group_ref, queued FROM agent_dispatch_queue_count ORDER BY 1, 2"
            ).fetchall()
            actual = conn.execute(
                "SELECT tenant_ref, group_ref, count(*) FROM agent_dispatch_queue GROUP BY 1, 2 ORDER BY 1, 2"
            ).fetchall()
            assert counts == actual and sum(c[2] for c in counts) == 6
            columns = conn.execute(
                "SELECT count(*) FROM information_schema.columns WHERE column_name = 'queued' "
                "AND table_name IN ('agent_dispatch_queue_tenant', 'agent_dispatch_queue_group')"
            ).fetchone()
            assert columns == (0,)
        assert queue.depth() == 6

        # The old claims' receipts still work, one acknowledged and one given back.
        row_id, token, at = live["a3"]
        queue.ack(Receipt("old-worker", _Claim(row_id, token, at).encode()))
        row_id, token, at = live["b1"]
        queue.release(Receipt("old-worker", _Claim(row_id, token, at).encode()))

        # New admissions join the old tenants' history; everything ready is claimed once.
        queue.admit([OutboundTurn("a5", "s-a5", "tenant-a", b"a5", fairness_group="g1")])
        seen: list[str] = []
        while got := queue.claim("new-worker", max_items=2):
            seen += [d.work_item_id for d in got]
            assert not queue.ack_many([d.receipt for d in got])
        assert sorted(seen) == ["a1", "a2", "a5", "b1", "b2"]
        assert queue.depth() == 1  # a4, delayed

        # Only the delayed turn's tenant and group keep history once pruned.
        queue.prune_history()
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            assert conn.execute("SELECT tenant_ref FROM agent_dispatch_queue_tenant").fetchall() == [
                (ref(salt, "tenant", "tenant-a"),)
            ]
            assert conn.execute("SELECT group_ref, queued FROM agent_dispatch_queue_count").fetchall() == [
                (ref(salt, "group", "tenant-a", "g2"), 1)
            ]
    finally:
        queue.close()

    # A second start finds the current version and changes nothing.
    again = PostgresTransport(postgres_dsn, max_depth=100, visibility_timeout_s=300)
    again.ensure_ready()
    assert again.depth() == 1
    again.close()


def test_a_newer_queue_schema_is_refused(postgres_dsn: str) -> None:
    queue = PostgresTransport(postgres_dsn, max_depth=100, visibility_timeout_s=300)
    queue.ensure_ready()
    queue.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE agent_dispatch_queue_meta SET value = %s WHERE key = 'schema_version'",
            (str(_pg_schema.SCHEMA_VERSION + 1).encode(),),
        )
    newer = PostgresTransport(postgres_dsn, max_depth=100, visibility_timeout_s=300)
    with pytest.raises(SchemaOutdated, match="upgrade agent-dispatch"):
        newer.ensure_ready()
    newer.close()
