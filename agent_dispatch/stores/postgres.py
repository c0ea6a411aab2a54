"""The PostgreSQL WorkItem store: the production authority (``STATE_DB_URI``).

Many workers write at once here, so nothing is decided by reading and then writing. Every
fenced transition is one conditional ``UPDATE ... WHERE id AND tenant AND owner AND epoch AND
token AND lease_expires_at > now() RETURNING``; only when it matches no row does a follow-up
read classify the refusal (with the same function the other stores use). Fencing tokens come
from one global SEQUENCE. The next ready item is claimed with ``FOR UPDATE SKIP LOCKED`` over a
partial index whose key is exactly the claim's ORDER BY, and an expired lease is reclaimable by
the same statement. Every time is the database's ``now()``: a worker's clock is never consulted.

Round trips: for an item nobody depends on, a claim and a commit are one autocommit statement
each (the lease and its provenance record in one statement through a data-modifying CTE). An
item with dependents takes the transactional form, because releasing or cancelling them must
happen in the same transaction: the fast statements carry ``NOT has_dependents`` so they can
never settle such an item alone. A worker's batch is two statements in all: ``start_many`` leases,
starts and reads every simply claimable item of the batch (``START_MANY``), ``commit_many`` commits
every current lease of an item nobody depends on (``COMMIT_MANY``); what either leaves out goes
the one-by-one way above.

Dependencies are exact under concurrency: a dependency counts its dependents down
(``pending_deps``) with an UPDATE of the dependent row, which PostgreSQL serialises per row, and
the release/cancel runs as a *separate statement in the same transaction* after the dependency's
row is locked, so it sees any dependent whose submit committed while it waited for that lock
(a submit locks its dependencies and sets their ``has_dependents`` flag first).

``set_clock_offset_for_tests`` adds a fixed interval to ``now()`` in every statement (the
``off`` parameter, 0 in production). It exists only so tests can age leases without sleeping.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from typing import Any, Final, TypeVar

import psycopg
from psycopg import Connection, errors
from psycopg.rows import DictRow, dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from agent_dispatch.errors import (
    BackendUnavailable,
    DispatchError,
    Fenced,
    InvalidRequest,
    InvalidTransition,
    LeaseHeld,
    NotFound,
    SchemaOutdated,
    TenantMismatch,
)
from agent_dispatch.models import (
    CommitResult,
    Lease,
    Outcome,
    OutcomeRecord,
    SubmitRequest,
    SubmitResult,
    WorkItem,
    WorkState,
)
from agent_dispatch.settings import Settings
from agent_dispatch.settings import load as load_settings
from agent_dispatch.store import SCHEMA_VERSION, StartedTurn, backoff_s, bound_error
from agent_dispatch.stores._common import (
    COMMIT_STATE,
    COMPONENT,
    DEPENDENCY_FAILED,
    ITEM_COLUMNS,
    ITEM_SELECT,
    MIGRATE_HINT,
    OUTCOME_SELECT,
    Limits,
    Prepared,
    View,
    check_named_claim,
    check_owner,
    dependency_reason,
    distinct_claims,
    distinct_commits,
    fence_violation,
    idempotency_conflict,
    make_item,
    make_lease,
    prepare_batch,
    prepare_submit,
    repeated_commit,
    require_dt,
    view_of,
)

R = TypeVar("R")
Conn = Connection[DictRow]

T: Final = "agent_dispatch_work_items"
DEPS: Final = "agent_dispatch_dependencies"
OUTCOMES: Final = "agent_dispatch_outcomes"
VERSIONS: Final = "agent_dispatch_schema_version"
TOKENS: Final = "agent_dispatch_fencing_token_seq"

# The authority's clock, shifted only by the test hook (``off`` is 0 in production).
NOW: Final = "(now() + %(off)s::float8 * interval '1 second')"
ACTIVE: Final = "state IN ('ready', 'leased', 'running')"
NON_TERMINAL: Final = "state IN ('submitted', 'ready', 'leased', 'running')"
RETURN_ITEM: Final = ITEM_SELECT + ", has_dependents"
RETURN_W: Final = ", ".join(f"w.{c}" for c in ITEM_COLUMNS) + ", w.has_dependents"


def _param(name: str) -> str:
    """A value of the one request a statement serves: its named parameter."""
    return f"%({name})s"


def _column(name: str) -> str:
    """A value of one request of a batch: its column of the unnested arrays (see ``commit_sql``)."""
    return f"c_{name}"


def fence_sql(arg: Callable[[str], str] = _param) -> str:
    """The fence condition: the row is held by exactly this lease (``arg`` names where its fields come from)."""
    return (
        f"id = {arg('id')} AND tenant = {arg('tenant')} AND lease_owner = {arg('owner')}"
        f" AND lease_epoch = {arg('epoch')}"
        f" AND fencing_token = {arg('token')} AND state IN ('leased', 'running')"
        # Written as a difference, not ``lease_expires_at > now``: that form would tempt the planner
        # into the lease-expiry index (cost: every live lease) instead of the primary key (one row).
        f" AND lease_expires_at - {NOW} > interval '0'"
    )


FENCE: Final = fence_sql()
#: The single-statement fast path: an item nobody depends on needs nothing else in its transaction.
NO_DEPENDENTS: Final = " AND NOT has_dependents"
#: A claim or retry that cannot dead-letter, or can without dependents to cancel.
NO_CASCADE: Final = " AND (attempt < max_attempts OR NOT has_dependents)"


def _event_select(event: str, outcome: str = "NULL", detail: str = "NULL", owner: str = "lease_owner") -> str:
    """One provenance record per row of the ``upd`` CTE, in :data:`OUTCOME_SELECT` order."""
    return (
        f"SELECT id, tenant, {event}, {owner}, lease_epoch, fencing_token, updated_at, {outcome}, {detail}"
        " FROM upd"
    )


def _event_sql(event: str, outcome: str = "NULL", detail: str = "NULL", owner: str = "lease_owner") -> str:
    """An INSERT of one provenance record per row of the ``upd`` CTE (for ``WITH ... ev AS (...)``)."""
    return f"INSERT INTO {OUTCOMES} ({OUTCOME_SELECT}) " + _event_select(event, outcome, detail, owner)


# --- schema ------------------------------------------------------------------------------------------

#: version -> statements. Append new versions; never edit one that has shipped.
MIGRATIONS: Final[Mapping[int, Sequence[str]]] = {
    1: (
        f"CREATE SEQUENCE {TOKENS} AS bigint",
        f"""CREATE TABLE {T} (
            seq bigint GENERATED ALWAYS AS IDENTITY,
            id text PRIMARY KEY,
            tenant text NOT NULL CHECK (tenant <> ''),
            kind text NOT NULL,
            queue text NOT NULL,
            session_id text NOT NULL,
            state text NOT NULL CHECK (state IN ('submitted', 'ready', 'leased', 'running',
                                                 'succeeded', 'failed', 'cancelled', 'dead_letter')),
            priority integer NOT NULL,
            deadline timestamptz,
            attempt integer NOT NULL CHECK (attempt >= 0 AND attempt <= max_attempts),
            max_attempts integer NOT NULL CHECK (max_attempts >= 1),
            lease_epoch bigint NOT NULL DEFAULT 0,
            fencing_token bigint NOT NULL DEFAULT 0,
            lease_owner text,
            lease_expires_at timestamptz,
            not_before timestamptz,
            idempotency_key text,
            depends_on text[] NOT NULL DEFAULT '{{}}',
            pending_deps integer NOT NULL DEFAULT 0,
            has_dependents boolean NOT NULL DEFAULT false,
            fairness_group text,
            payload bytea NOT NULL,
            payload_size integer NOT NULL,
            payload_digest bytea NOT NULL,
            outcome text,
            error text,
            commit_token bigint,
            last_dispatched_at timestamptz,
            created_at timestamptz NOT NULL,
            updated_at timestamptz NOT NULL,
            UNIQUE (tenant, idempotency_key)
        )""",
        # Exactly the claim's ORDER BY, over the claimable states only: the claim reads the
        # head of this index whatever the backlog (terminal rows are not in it at all).
        f"CREATE INDEX {T}_claim_queue ON {T} (queue, priority DESC, seq) WHERE {ACTIVE}",
        f"CREATE INDEX {T}_claim_any ON {T} (priority DESC, seq) WHERE {ACTIVE}",
        f"CREATE INDEX {T}_leases ON {T} (lease_expires_at) WHERE state IN ('leased', 'running')",
        f"CREATE INDEX {T}_dispatch ON {T} (last_dispatched_at NULLS FIRST) WHERE state = 'ready'",
        f"CREATE INDEX {T}_deadline ON {T} (deadline) WHERE deadline IS NOT NULL AND {NON_TERMINAL}",
        f"CREATE INDEX {T}_tenant ON {T} (tenant, seq)",
        f"""CREATE TABLE {DEPS} (
            dependency text NOT NULL,
            dependent text NOT NULL REFERENCES {T} (id),
            PRIMARY KEY (dependency, dependent)
        )""",
        f"""CREATE TABLE {OUTCOMES} (
            seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            work_item_id text NOT NULL,
            tenant text NOT NULL,
            event text NOT NULL,
            owner text,
            lease_epoch bigint NOT NULL,
            fencing_token bigint NOT NULL,
            at timestamptz NOT NULL,
            outcome text,
            detail text
        )""",
        f"CREATE INDEX {OUTCOMES}_item ON {OUTCOMES} (work_item_id, seq)",
        # Append-only in the database, not just by convention in this code.
        f"""CREATE FUNCTION {OUTCOMES}_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'outcome records are append-only'; END $$""",
        f"""CREATE TRIGGER {OUTCOMES}_append_only BEFORE UPDATE OR DELETE ON {OUTCOMES}
            FOR EACH ROW EXECUTE FUNCTION {OUTCOMES}_append_only()""",
    ),
}

#: Serialises concurrent ``migrate`` runs (a transaction-scoped advisory lock).
_MIGRATE_LOCK: Final = 0x6164_6D69_6772_0001


# --- statements ----------------------------------------------------------------------------------------

SELECT_VIEW: Final = (
    f"SELECT {ITEM_SELECT}, commit_token, lease_expires_at > {NOW} AS live,"
    f" (not_before IS NULL OR not_before <= {NOW}) AS due FROM {T} WHERE id = %(id)s"
)
SELECT_ITEM: Final = f"SELECT {ITEM_SELECT} FROM {T} WHERE id = %(id)s"
SELECT_BY_KEY: Final = (
    f"SELECT {ITEM_SELECT}, payload_digest FROM {T} WHERE tenant = %(tenant)s AND idempotency_key = %(key)s"
)
SELECT_BY_ID_FOR_SUBMIT: Final = f"SELECT {ITEM_SELECT}, payload_digest FROM {T} WHERE id = %(id)s"

# Lock the dependencies in id order (no deadlock between two submits) and flag them, so their
# own terminal transition learns, from the row it locks, that it has dependents to update.
LOCK_DEPENDENCIES: Final = (
    f"UPDATE {T} SET has_dependents = true WHERE id IN"
    f" (SELECT id FROM {T} WHERE id = ANY(%(deps)s) AND tenant = %(tenant)s ORDER BY id FOR UPDATE)"
    " RETURNING id, state"
)
INSERT_ITEM: Final = f"""
WITH ins AS (
    INSERT INTO {T} (id, tenant, kind, queue, session_id, state, priority, deadline, attempt,
                     max_attempts, idempotency_key, depends_on, pending_deps, fairness_group,
                     payload, payload_size, payload_digest, outcome, error, created_at, updated_at,
                     last_dispatched_at)
    VALUES (%(id)s, %(tenant)s, %(kind)s, %(queue)s, %(session_id)s, %(state)s, %(priority)s,
            %(deadline)s, 0, %(max_attempts)s, %(key)s, %(depends_on)s, %(pending)s,
            %(fairness_group)s, %(payload)s, %(payload_size)s, %(digest)s, %(outcome)s, %(error)s,
            {NOW}, {NOW}, CASE WHEN %(dispatched)s AND %(state)s = 'ready' THEN {NOW} END)
    ON CONFLICT DO NOTHING
    RETURNING {ITEM_SELECT}
), ev AS (
    INSERT INTO {OUTCOMES} ({OUTCOME_SELECT})
    SELECT id, tenant, 'submit', NULL, 0, 0, created_at, NULL, NULL FROM ins
    UNION ALL
    SELECT id, tenant, 'cancel', NULL, 0, 0, created_at, outcome, error FROM ins WHERE state = 'cancelled'
)
SELECT * FROM ins
"""
# Array parameters go in binary (``%(x)b``): psycopg's text array dumper quotes every element
# with a regular expression, about a fifth of a batch submitter's CPU.
# A batch of ready items without dependencies in one statement (``submit_many_in_transaction``):
# a request whose id or idempotency key exists already (or earlier in the batch) is not returned.
INSERT_MANY: Final = f"""
WITH input AS (
    SELECT * FROM unnest(%(ids)b::text[], %(tenants)b::text[], %(kinds)b::text[], %(queues)b::text[],
                         %(sessions)b::text[], %(priorities)b::integer[], %(deadlines)b::timestamptz[],
                         %(max_attempts)b::integer[], %(keys)b::text[], %(groups)b::text[],
                         %(payloads)b::bytea[], %(digests)b::bytea[])
           WITH ORDINALITY AS u(id, tenant, kind, queue, session_id, priority, deadline, max_attempts,
                                idempotency_key, fairness_group, payload, payload_digest, ord)
), ins AS (
    INSERT INTO {T} (id, tenant, kind, queue, session_id, state, priority, deadline, attempt,
                     max_attempts, idempotency_key, fairness_group, payload, payload_size,
                     payload_digest, created_at, updated_at, last_dispatched_at)
    SELECT id, tenant, kind, queue, session_id, 'ready', priority, deadline, 0, max_attempts,
           idempotency_key, fairness_group, payload, octet_length(payload), payload_digest,
           {NOW}, {NOW}, CASE WHEN %(dispatched)s THEN {NOW} END
      FROM input ORDER BY ord
    ON CONFLICT DO NOTHING
    RETURNING {ITEM_SELECT}
), ev AS (
    INSERT INTO {OUTCOMES} ({OUTCOME_SELECT})
    SELECT id, tenant, 'submit', NULL, 0, 0, created_at, NULL, NULL FROM ins
)
SELECT * FROM ins
"""
INSERT_DEPENDENCIES: Final = (
    f"INSERT INTO {DEPS} (dependency, dependent) SELECT unnest(%(deps)b::text[]), %(id)s"
)

# Lease the candidate, or dead-letter it when another attempt would exceed its maximum.
_FRESH: Final = "w.attempt < w.max_attempts"


def _take_sql(leased: str = "leased", returning: str = "", *, named: bool = False) -> str:
    """Lease each ``cand`` row into state ``leased`` (start_many takes it straight to 'running').

    ``named``: the rows are among the ``ids`` array, which gives the planner a primary-key path
    to them however few rows it believes the table holds (else a small table is scanned whole).
    """
    return f"""
    UPDATE {T} w SET
        state = CASE WHEN {_FRESH} THEN '{leased}' ELSE 'dead_letter' END,
        attempt = CASE WHEN {_FRESH} THEN w.attempt + 1 ELSE w.attempt END,
        lease_epoch = CASE WHEN {_FRESH} THEN w.lease_epoch + 1 ELSE w.lease_epoch END,
        fencing_token = CASE WHEN {_FRESH} THEN nextval('{TOKENS}') ELSE w.fencing_token END,
        lease_owner = CASE WHEN {_FRESH} THEN %(owner)s ELSE w.lease_owner END,
        lease_expires_at = CASE WHEN {_FRESH} THEN {NOW} + %(ttl)s::float8 * interval '1 second' END,
        not_before = NULL,
        commit_token = NULL,
        outcome = CASE WHEN {_FRESH} THEN w.outcome ELSE 'failed' END,
        error = CASE WHEN {_FRESH} THEN w.error
                ELSE 'attempts exhausted (' || w.attempt || ' of ' || w.max_attempts || ')' END,
        updated_at = {NOW}
    FROM cand WHERE w.id = cand.cid AND cand.simple{" AND w.id = ANY(%(ids)b::text[])" if named else ""}
    RETURNING {RETURN_W}, cand.prev_state, cand.prev_owner{returning}
"""


def _take_event_sql(leased: str = "leased", then: str = "") -> str:
    """The 'claim' (or 'dead_letter') record of each row ``_take_sql(leased)`` updated, ``then`` more."""
    return f"""
    INSERT INTO {OUTCOMES} ({OUTCOME_SELECT})
    SELECT id, tenant, CASE WHEN state = '{leased}' THEN 'claim' ELSE 'dead_letter' END, lease_owner,
           lease_epoch, fencing_token, updated_at,
           CASE WHEN state = '{leased}' THEN NULL ELSE outcome END,
           CASE WHEN state <> '{leased}' THEN error
                WHEN prev_state <> 'ready' THEN 'reclaimed an expired lease held by ' || prev_owner END
    FROM upd{then}
"""


_TAKE: Final = _take_sql()
_TAKE_EVENT: Final = _take_event_sql()
_CLAIMABLE: Final = (
    f"{ACTIVE} AND CASE WHEN state = 'ready' THEN coalesce(not_before <= {NOW}, true)"
    f" ELSE lease_expires_at <= {NOW} END"
)


def claim_next_sql(*, queue: bool, tenant: bool) -> str:
    """The claim of the next item, one autocommit statement; a text per filter, each with its plan.

    It leases the first claimable item, or dead-letters it when its attempts are spent. One case
    it leaves alone: spent attempts *and* dependents, whose cancellation needs a second statement
    in the same transaction. Then it returns only the candidate's id (``candidate``, with NULL
    item columns) and the caller claims that item by name in a transaction, keeping the order.
    """
    filters = (" AND queue = %(queue)s" if queue else "") + (" AND tenant = %(tenant)s" if tenant else "")
    return f"""
WITH cand AS (
    SELECT id AS cid, state AS prev_state, lease_owner AS prev_owner,
           (attempt < max_attempts OR NOT has_dependents) AS simple
    FROM {T}
    WHERE {_CLAIMABLE}{filters}
    ORDER BY priority DESC, seq
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), upd AS ({_TAKE}), ev AS ({_TAKE_EVENT})
SELECT cand.cid AS candidate, upd.* FROM cand LEFT JOIN upd ON upd.id = cand.cid
"""


CLAIM_NEXT: Final = {(q, t): claim_next_sql(queue=q, tenant=t) for q in (False, True) for t in (False, True)}


def claim_named_sql(*, fast: bool) -> str:
    """The claim of one named item; ``fast`` (autocommit) leaves the spent-with-dependents case
    to the transactional form, like the next-item claim does."""
    simple = "(attempt < max_attempts OR NOT has_dependents)" if fast else "true"
    return f"""
WITH cand AS (
    SELECT id AS cid, state AS prev_state, lease_owner AS prev_owner, {simple} AS simple FROM {T}
    WHERE id = %(id)s AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s) AND {_CLAIMABLE}
    FOR UPDATE
), upd AS ({_TAKE}), ev AS ({_TAKE_EVENT})
SELECT * FROM upd
"""


CLAIM_NAMED: Final = claim_named_sql(fast=False)
CLAIM_NAMED_FAST: Final = claim_named_sql(fast=True)
MARK_RUNNING: Final = f"""
WITH upd AS (
    UPDATE {T} SET state = 'running', updated_at = {NOW}
    WHERE {FENCE} AND state = 'leased'
    RETURNING {RETURN_ITEM}
), ev AS ({_event_sql("'running'")})
SELECT * FROM upd
"""

# start_many: claim + mark_running for a batch of named items, one autocommit statement. Only the
# simply claimable are taken (attempts left, so no dead letter and nothing to cascade; deadline not
# passed; tenant as named); a row another transaction has locked is skipped, not waited for. The
# records are 'claim' then 'running' per item (a UNION ALL is inserted branch by branch, in order).
# Each named row is found by a lateral primary-key lookup: joined to the unnested arrays instead,
# the cached generic plan scanned every active item (the whole queue) for each batch.
START_MANY: Final = f"""
WITH cand AS (
    SELECT w.id AS cid, w.state AS prev_state, w.lease_owner AS prev_owner, true AS simple
    FROM unnest(%(ids)b::text[], %(tenants)b::text[]) AS req(rid, rtenant)
    CROSS JOIN LATERAL (
        SELECT id, state, lease_owner FROM {T}
        WHERE id = req.rid AND tenant = req.rtenant AND {_CLAIMABLE} AND attempt < max_attempts
          AND (deadline IS NULL OR deadline - {NOW} > interval '0')
        FOR UPDATE SKIP LOCKED
    ) AS w
), upd AS ({_take_sql("running", ", w.payload", named=True)}), ev AS ({
    _take_event_sql("running", " UNION ALL " + _event_select("'running'"))
})
SELECT * FROM upd
"""
RENEW: Final = (
    f"UPDATE {T} SET lease_expires_at = {NOW} + %(ttl)s::float8 * interval '1 second', updated_at = {NOW}"
    f" WHERE {FENCE} RETURNING {ITEM_SELECT}"
)


#: commit_many's requests, one row per lease; ``_column`` names its columns.
COMMIT_BATCH: Final = (
    "unnest(%(ids)b::text[], %(tenants)b::text[], %(owners)b::text[], %(epochs)b::bigint[],"
    " %(tokens)b::bigint[], %(states)b::text[], %(outcomes)b::text[], %(errors)b::text[])"
    " AS c(c_id, c_tenant, c_owner, c_epoch, c_token, c_state, c_outcome, c_error)"
)


def commit_sql(extra: str = "", *, batch: bool = False) -> str:
    """The fenced terminal commit of one lease, or (``batch``) of every lease in COMMIT_BATCH's arrays.

    A batch finds and locks each fenced row by a lateral primary-key lookup, then updates what it
    locked, again by primary key: with the fence in the UPDATE's own WHERE, the generic plan walked
    every live lease (the lease-expiry index) for each batch.
    """
    arg = _column if batch else _param
    where = (
        f""" FROM (
        SELECT c.*, w.wid FROM {COMMIT_BATCH}
        CROSS JOIN LATERAL (SELECT id AS wid FROM {T} WHERE {fence_sql(arg)}{extra} FOR UPDATE) AS w
    ) AS c
    WHERE id = c.wid AND id = ANY(%(ids)b::text[])"""
        if batch
        else f"\n    WHERE {fence_sql(arg)}{extra}"
    )
    return f"""
WITH upd AS (
    UPDATE {T} SET state = {arg("state")}, outcome = {arg("outcome")}, error = {arg("error")},
        commit_token = fencing_token, lease_expires_at = NULL, updated_at = {NOW}{where}
    RETURNING {RETURN_ITEM}
), ev AS ({_event_sql("'commit'", "outcome", "error")})
SELECT * FROM upd
"""


COMMIT: Final = commit_sql()
COMMIT_FAST: Final = commit_sql(NO_DEPENDENTS)
COMMIT_MANY: Final = commit_sql(NO_DEPENDENTS, batch=True)


def retry_sql(extra: str = "") -> str:
    return f"""
WITH upd AS (
    UPDATE {T} SET
        state = CASE WHEN attempt >= max_attempts THEN 'dead_letter' ELSE 'ready' END,
        not_before = CASE WHEN attempt >= max_attempts THEN NULL
                          ELSE {NOW} + %(backoff)s::float8 * interval '1 second' END,
        lease_owner = CASE WHEN attempt >= max_attempts THEN lease_owner END,
        outcome = 'failed', error = %(error)s, commit_token = fencing_token,
        lease_expires_at = NULL, updated_at = {NOW}
    WHERE {FENCE}{extra}
    RETURNING {RETURN_ITEM}
), ev AS ({
        _event_sql(
            "CASE WHEN state = 'ready' THEN 'retry' ELSE 'dead_letter' END", "outcome", "error", "%(owner)s"
        )
    })
SELECT * FROM upd
"""


RETRY: Final = retry_sql()
RETRY_FAST: Final = retry_sql(NO_CASCADE)
DEFER: Final = f"""
WITH upd AS (
    UPDATE {T} SET state = 'ready', attempt = greatest(attempt - 1, 0),
        not_before = CASE WHEN %(delay)s::float8 > 0
                          THEN {NOW} + %(delay)s::float8 * interval '1 second' END,
        lease_owner = NULL, lease_expires_at = NULL, commit_token = NULL, updated_at = {NOW}
    WHERE {FENCE}
    RETURNING {RETURN_ITEM}
), ev AS ({_event_sql("'defer'", detail="%(detail)s", owner="%(owner)s")})
SELECT * FROM upd
"""
CANCEL: Final = f"""
WITH upd AS (
    UPDATE {T} SET state = 'cancelled', outcome = 'cancelled', error = %(reason)s,
        lease_expires_at = NULL, updated_at = {NOW}
    WHERE id = %(id)s AND tenant = %(tenant)s AND {NON_TERMINAL}
    RETURNING {RETURN_ITEM}
), ev AS ({_event_sql("'cancel'", "outcome", "error")})
SELECT * FROM upd
"""
DEAD_LETTER: Final = f"""
WITH upd AS (
    UPDATE {T} SET state = 'dead_letter', error = %(reason)s, lease_expires_at = NULL, updated_at = {NOW}
    WHERE id = %(id)s AND {NON_TERMINAL}
    RETURNING {RETURN_ITEM}
), ev AS ({_event_sql("'dead_letter'", detail="error")})
SELECT * FROM upd
"""
EXPIRE: Final = f"""
WITH cand AS (
    SELECT id AS cid FROM {T}
    WHERE deadline IS NOT NULL AND {NON_TERMINAL} AND deadline <= {NOW}
    ORDER BY deadline LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), upd AS (
    UPDATE {T} w SET state = 'cancelled', outcome = 'cancelled', error = 'deadline expired',
        lease_expires_at = NULL, updated_at = {NOW}
    FROM cand WHERE w.id = cand.cid
    RETURNING {RETURN_W}
), ev AS ({_event_sql("'expire'", "outcome", "error")})
SELECT * FROM upd
"""
# One level of a cascade: a statement of its own, after the parent's row is locked (see above).
CASCADE: Final = f"""
WITH upd AS (
    UPDATE {T} w SET state = 'cancelled', outcome = 'cancelled', error = %(reason)s,
        lease_expires_at = NULL, updated_at = {NOW}
    FROM {DEPS} d
    WHERE d.dependency = %(parent)s AND w.id = d.dependent AND w.{NON_TERMINAL}
    RETURNING {RETURN_W}
), ev AS ({_event_sql("'cancel'", "outcome", "error")})
SELECT id, state, has_dependents FROM upd
"""
RELEASE: Final = f"""
WITH upd AS (
    UPDATE {T} w SET pending_deps = greatest(w.pending_deps - 1, 0),
        state = CASE WHEN w.pending_deps <= 1 THEN 'ready' ELSE 'submitted' END,
        updated_at = {NOW}
    FROM {DEPS} d
    WHERE d.dependency = %(parent)s AND w.id = d.dependent AND w.state = 'submitted'
    RETURNING {RETURN_W}
), ev AS (
    INSERT INTO {OUTCOMES} ({OUTCOME_SELECT})
    SELECT id, tenant, 'ready', lease_owner, lease_epoch, fencing_token, updated_at, NULL,
           'dependency ' || %(parent)s || ' succeeded'
    FROM upd WHERE state = 'ready'
)
SELECT count(*) AS n FROM upd
"""
RECOVERABLE: Final = f"""
(SELECT {ITEM_SELECT} FROM {T}
 WHERE state IN ('leased', 'running') AND lease_expires_at <= {NOW}
 ORDER BY lease_expires_at LIMIT %(limit)s)
UNION ALL
(SELECT {ITEM_SELECT} FROM {T}
 WHERE state = 'ready'
   AND (last_dispatched_at IS NULL OR last_dispatched_at <= {NOW} - %(stale)s::float8 * interval '1 second')
   AND (not_before IS NULL OR not_before <= {NOW})
 ORDER BY last_dispatched_at NULLS FIRST LIMIT %(limit)s)
"""
MARK_DISPATCHED: Final = f"UPDATE {T} SET last_dispatched_at = {NOW} WHERE id = ANY(%(ids)s)"
SELECT_OUTCOMES: Final = f"SELECT {OUTCOME_SELECT} FROM {OUTCOMES} WHERE work_item_id = %(id)s ORDER BY seq"
SELECT_PAYLOAD: Final = f"SELECT payload FROM {T} WHERE id = %(id)s AND tenant = %(tenant)s"
SELECT_NOW: Final = f"SELECT {NOW} AS now"

_RETRYABLE: Final = (errors.DeadlockDetected, errors.SerializationFailure)
_ATTEMPTS: Final = 5


def _leader_key(name: str) -> int:
    digest = hashlib.sha256(f"agent-dispatch:leader:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class PostgresStore:
    """WorkItemStore on PostgreSQL through a psycopg connection pool."""

    def __init__(
        self,
        dsn: str,
        settings: Settings | None = None,
        *,
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.limits = Limits.of(settings or load_settings())
        self._dsn = dsn
        self._off = 0.0
        self._schema_ok = False
        self._lock = threading.Lock()
        self._leaders: dict[str, psycopg.Connection[Any]] = {}
        try:
            # One plain connection first: an unreachable server fails fast, once, with one message
            # (the pool would retry quietly until its timeout).
            psycopg.connect(dsn, connect_timeout=max(int(connect_timeout_s), 1)).close()
        except psycopg.Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BackendUnavailable(f"PostgreSQL (STATE_DB_URI) is unreachable: {first}") from exc
        self._pool: ConnectionPool[Conn] = ConnectionPool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            open=False,
            connection_class=Connection[DictRow],
            kwargs={"autocommit": True, "row_factory": dict_row, "connect_timeout": int(connect_timeout_s)},
            name="agent-dispatch-store",
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
        except PoolTimeout as exc:
            self._pool.close()
            raise BackendUnavailable("PostgreSQL (STATE_DB_URI) is unreachable") from exc

    # --- plumbing -----------------------------------------------------------------------------------------

    def set_clock_offset_for_tests(self, seconds: float) -> None:
        """Test hook: every statement's ``now()`` is shifted by ``seconds`` (see the module docstring)."""
        self._off = float(seconds)

    def _p(self, **params: Any) -> dict[str, Any]:
        params["off"] = self._off
        return params

    def _run(self, fn: Callable[[Conn], R], *, transaction: bool = True, check_schema: bool = True) -> R:
        """Run ``fn`` on a pooled connection (in one transaction), retrying deadlock victims."""
        if check_schema:
            self._check_schema()
        for attempt in range(_ATTEMPTS):
            try:
                with self._pool.connection() as conn:
                    if not transaction:
                        return fn(conn)
                    with conn.transaction():
                        return fn(conn)
            except _RETRYABLE:
                # The whole transaction was rolled back, so running it again is safe.
                if attempt == _ATTEMPTS - 1:
                    raise
                time.sleep(random.uniform(0.001, 0.02) * (attempt + 1))  # noqa: S311 (jitter)
            except (psycopg.OperationalError, PoolTimeout) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise BackendUnavailable(f"PostgreSQL is unavailable: {first}") from exc
        raise AssertionError("unreachable")

    def _one(self, conn: Conn, sql: str, params: Mapping[str, Any]) -> DictRow | None:
        return conn.execute(sql, params).fetchone()

    def _view(self, conn: Conn, work_item_id: str) -> View | None:
        rec = self._one(conn, SELECT_VIEW, self._p(id=work_item_id))
        return None if rec is None else view_of(rec)

    def _fence_params(self, lease: Lease, **extra: Any) -> dict[str, Any]:
        return self._p(
            id=lease.work_item_id,
            tenant=lease.tenant,
            owner=lease.owner,
            epoch=lease.lease_epoch,
            token=lease.fencing_token,
            **extra,
        )

    def _refused(self, conn: Conn, lease: Lease) -> DispatchError:
        """The conditional UPDATE matched nothing: say exactly why."""
        violation = fence_violation(self._view(conn, lease.work_item_id), lease)
        # Everything matched on the re-read: the row changed between the two statements.
        return violation or Fenced(f"the lease on work item {lease.work_item_id} changed concurrently")

    # --- schema -------------------------------------------------------------------------------------------

    def _version(self, conn: Conn) -> int:
        rec = self._one(conn, "SELECT to_regclass(%(t)s) IS NOT NULL AS present", {"t": VERSIONS})
        if rec is None or not rec["present"]:
            return 0
        rec = self._one(
            conn,
            f"SELECT coalesce(max(version), 0) AS v FROM {VERSIONS} WHERE component = %(c)s",
            {"c": COMPONENT},
        )
        return 0 if rec is None else int(rec["v"])

    def _check_schema(self) -> None:
        if self._schema_ok:
            return
        version = self._run(self._version, transaction=False, check_schema=False)
        if version < SCHEMA_VERSION:
            raise SchemaOutdated(
                f"the WorkItem schema in PostgreSQL is at version {version}; this code needs "
                f"{SCHEMA_VERSION}: {MIGRATE_HINT}"
            )
        self._schema_ok = True

    def migrate(self) -> int:
        def apply(conn: Conn) -> int:
            conn.execute("SELECT pg_advisory_xact_lock(%(k)s)", {"k": _MIGRATE_LOCK})
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {VERSIONS} (component text NOT NULL, version integer NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (component, version))"
            )
            current = self._version(conn)
            for version in sorted(v for v in MIGRATIONS if v > current):
                for statement in MIGRATIONS[version]:
                    conn.execute(statement)
                conn.execute(
                    f"INSERT INTO {VERSIONS} (component, version) VALUES (%(c)s, %(v)s)",
                    {"c": COMPONENT, "v": version},
                )
                current = version
            return current

        version = self._run(apply, check_schema=False)
        self._schema_ok = version >= SCHEMA_VERSION
        return version

    # --- clock and reads -------------------------------------------------------------------------------------

    def now(self) -> datetime:
        rec = self._run(lambda c: self._one(c, SELECT_NOW, self._p()), transaction=False, check_schema=False)
        assert rec is not None
        return require_dt(rec["now"])

    def get(self, work_item_id: str, *, tenant: str | None = None) -> WorkItem:
        rec = self._run(lambda c: self._one(c, SELECT_ITEM, {"id": work_item_id}), transaction=False)
        if rec is None or (tenant is not None and rec["tenant"] != tenant):
            raise NotFound(f"work item {work_item_id} not found")
        return make_item(rec)

    def get_payload(self, work_item_id: str, *, tenant: str) -> bytes:
        rec = self._run(
            lambda c: self._one(c, SELECT_PAYLOAD, {"id": work_item_id, "tenant": tenant}), transaction=False
        )
        if rec is None:
            raise NotFound(f"work item {work_item_id} not found")
        return bytes(rec["payload"])

    def list_items(
        self,
        *,
        tenant: str,
        states: Sequence[WorkState] = (),
        limit: int = 100,
        after: str | None = None,
    ) -> list[WorkItem]:
        if limit < 1:
            raise InvalidRequest("limit must be at least 1")
        where = ["tenant = %(tenant)s"]
        if states:
            where.append("state = ANY(%(states)s)")
        if after is not None:
            where.append(f"seq < (SELECT seq FROM {T} WHERE id = %(after)s AND tenant = %(tenant)s)")
        sql = f"SELECT {ITEM_SELECT} FROM {T} WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT %(limit)s"
        params = {
            "tenant": tenant,
            "states": [WorkState(s).value for s in states],
            "after": after,
            "limit": limit,
        }
        rows = self._run(lambda c: c.execute(sql, params).fetchall(), transaction=False)
        return [make_item(rec) for rec in rows]

    def outcomes(self, work_item_id: str) -> list[OutcomeRecord]:
        rows = self._run(
            lambda c: c.execute(SELECT_OUTCOMES, {"id": work_item_id}).fetchall(), transaction=False
        )
        return [
            OutcomeRecord(
                work_item_id=rec["work_item_id"],
                tenant=rec["tenant"],
                event=rec["event"],
                owner=rec["owner"],
                lease_epoch=int(rec["lease_epoch"]),
                fencing_token=int(rec["fencing_token"]),
                at=require_dt(rec["at"]),
                outcome=rec["outcome"],
                detail=rec["detail"],
            )
            for rec in rows
        ]

    def recoverable(self, *, stale_after_s: float, limit: int = 1000) -> list[WorkItem]:
        params = self._p(stale=stale_after_s, limit=limit)
        rows = self._run(lambda c: c.execute(RECOVERABLE, params).fetchall(), transaction=False)
        return [make_item(rec) for rec in rows[:limit]]

    # --- submit ----------------------------------------------------------------------------------------------

    def submit(self, request: SubmitRequest) -> SubmitResult:
        prepared = prepare_submit(request, self.limits)
        return self._run(lambda conn: self._submit(conn, prepared))

    def _existing(self, conn: Conn, prepared: Prepared) -> DictRow | None:
        rec = self._one(conn, SELECT_BY_ID_FOR_SUBMIT, {"id": prepared.id})
        if rec is None and prepared.idempotency_key is not None:
            rec = self._one(conn, SELECT_BY_KEY, {"tenant": prepared.tenant, "key": prepared.idempotency_key})
        return rec

    def _repeat(self, rec: DictRow, prepared: Prepared) -> SubmitResult:
        conflict = idempotency_conflict(rec, prepared)
        if conflict is not None:
            raise conflict
        return SubmitResult(make_item(rec), created=False)

    def _submit(self, conn: Conn, prepared: Prepared, *, dispatched: bool = False) -> SubmitResult:
        # A redelivered submit is the common repeat: answer it without taking any lock.
        existing = self._existing(conn, prepared)
        if existing is not None:
            return self._repeat(existing, prepared)
        states: dict[str, WorkState] = {}
        if prepared.depends_on:
            locked = conn.execute(
                LOCK_DEPENDENCIES, {"deps": list(prepared.depends_on), "tenant": prepared.tenant}
            ).fetchall()
            states = {rec["id"]: WorkState(rec["state"]) for rec in locked}
            missing = next((d for d in prepared.depends_on if d not in states), None)
            if missing is not None:
                raise NotFound(f"dependency {missing} not found")
        pending = sum(state is not WorkState.SUCCEEDED for state in states.values())
        dead = next((d for d in prepared.depends_on if states[d] in DEPENDENCY_FAILED), None)
        state, outcome, error = WorkState.SUBMITTED if pending else WorkState.READY, None, None
        if dead is not None:
            state, outcome, error = (
                WorkState.CANCELLED,
                Outcome.CANCELLED.value,
                dependency_reason(dead, states[dead]),
            )
        rec = self._one(
            conn,
            INSERT_ITEM,
            self._insert_params(
                prepared, state, pending=pending, outcome=outcome, error=error, dispatched=dispatched
            ),
        )
        if rec is None:
            # ON CONFLICT: a concurrent identical submit committed first (it waited for it).
            existing = self._existing(conn, prepared)
            if existing is None:
                raise errors.SerializationFailure("conflicting submit vanished; retrying")
            return self._repeat(existing, prepared)
        if prepared.depends_on:
            conn.execute(INSERT_DEPENDENCIES, {"deps": list(prepared.depends_on), "id": prepared.id})
        return SubmitResult(make_item(rec), created=True)

    def _insert_params(
        self,
        prepared: Prepared,
        state: WorkState,
        *,
        pending: int = 0,
        outcome: str | None = None,
        error: str | None = None,
        dispatched: bool = False,
    ) -> dict[str, Any]:
        return self._p(
            dispatched=dispatched,
            id=prepared.id,
            tenant=prepared.tenant,
            kind=prepared.kind,
            queue=prepared.queue,
            session_id=prepared.session_id,
            state=state.value,
            priority=prepared.priority,
            deadline=prepared.deadline,
            max_attempts=prepared.max_attempts,
            key=prepared.idempotency_key,
            depends_on=list(prepared.depends_on),
            pending=pending,
            fairness_group=prepared.fairness_group,
            payload=prepared.payload,
            payload_size=len(prepared.payload),
            digest=prepared.digest,
            outcome=outcome,
            error=error,
        )

    # --- one transaction with the queue (the enqueue path, agent_dispatch.dispatch) --------------------------

    @property
    def database_identity(self) -> str:
        """Which database this store writes; the enqueue path compares it with the transport's."""
        return self._dsn

    def submit_in_transaction(
        self, request: SubmitRequest, then: Callable[[Conn, WorkItem], None], *, dispatched: bool = False
    ) -> SubmitResult:
        """``submit``, then ``then(conn, item)`` for a newly created item in the SAME transaction.

        The queue in the same database admits the item's envelope there: if ``then`` raises, the
        WorkItem is rolled back with it, so a refused admission leaves no orphan. A deadlock
        victim is retried whole, ``then`` included. ``dispatched``: ``then`` admits every created
        ``ready`` item, so its dispatch time is stamped by the insert (no second write of the row).
        """
        prepared = prepare_submit(request, self.limits)

        def run(conn: Conn) -> SubmitResult:
            result = self._submit(conn, prepared, dispatched=dispatched)
            if result.created:
                then(conn, result.item)
            return result

        return self._run(run)

    def submit_many_in_transaction(
        self,
        requests: Sequence[SubmitRequest],
        then: Callable[[Conn, list[WorkItem]], None],
        *,
        dispatched: bool = False,
    ) -> list[SubmitResult | DispatchError]:
        """``submit`` for a batch in ONE transaction, then ``then(conn, created_items)`` in it too.

        For requests without dependencies (``InvalidRequest`` otherwise, before anything is
        written). Every request gets its own outcome, in order: a ``SubmitResult`` (a repeat of an
        existing item is ``created=False``, as with ``submit``) or the ``DispatchError`` that
        refused it (validation, an idempotency conflict). The inserts go to the server as one
        pipeline, so a batch costs a few round trips instead of a few per request. If ``then``
        raises, nothing of the batch is kept. A deadlock victim is retried whole. ``dispatched``
        as in :meth:`submit_in_transaction`.
        """
        prepared, refused = prepare_batch(requests, self.limits)

        def run(conn: Conn) -> list[SubmitResult | DispatchError]:
            outcomes: dict[int, SubmitResult | DispatchError] = dict(refused)
            inserted: dict[str, DictRow] = {}
            if prepared:
                ps = [p for _, p in prepared]
                params = self._p(
                    ids=[p.id for p in ps],
                    tenants=[p.tenant for p in ps],
                    kinds=[p.kind for p in ps],
                    queues=[p.queue for p in ps],
                    sessions=[p.session_id for p in ps],
                    priorities=[p.priority for p in ps],
                    deadlines=[p.deadline for p in ps],
                    max_attempts=[p.max_attempts for p in ps],
                    keys=[p.idempotency_key for p in ps],
                    groups=[p.fairness_group for p in ps],
                    payloads=[p.payload for p in ps],
                    digests=[p.digest for p in ps],
                    dispatched=dispatched,
                )
                with conn.cursor(row_factory=dict_row) as cur:
                    inserted = {rec["id"]: rec for rec in cur.execute(INSERT_MANY, params).fetchall()}
            created: list[WorkItem] = []
            for index, p in prepared:
                # A repeat of an id within the batch was inserted once, for its first request.
                rec = inserted.pop(p.id, None)
                if rec is not None:
                    item = make_item(rec)
                    outcomes[index] = SubmitResult(item, created=True)
                    created.append(item)
                    continue
                # ON CONFLICT: the same id or idempotency key exists (maybe earlier in this batch).
                existing = self._existing(conn, p)
                if existing is None:
                    raise errors.SerializationFailure("conflicting submit vanished; retrying")
                try:
                    outcomes[index] = self._repeat(existing, p)
                except DispatchError as exc:
                    outcomes[index] = exc
            then(conn, created)
            return [outcomes[i] for i in range(len(requests))]

        return self._run(run)

    # --- claim -----------------------------------------------------------------------------------------------

    def claim(
        self,
        owner: str,
        *,
        work_item_id: str | None = None,
        queue: str | None = None,
        tenant: str | None = None,
        ttl_s: float | None = None,
    ) -> Lease | None:
        check_owner(owner)
        ttl = self.limits.ttl(ttl_s)
        params = self._p(owner=owner, ttl=ttl, id=work_item_id, queue=queue, tenant=tenant)
        if work_item_id is not None:
            # Fast path: one autocommit statement. When it takes nothing, find out why (or take
            # the item in a transaction, if it must be dead-lettered with dependents to cancel).
            fast = self._run(lambda conn: self._take(conn, CLAIM_NAMED_FAST, params), transaction=False)
            if fast[0] is not None:
                return fast[1]
            return self._run(lambda conn: self._claim_named(conn, params))
        sql = CLAIM_NEXT[(queue is not None, tenant is not None)]
        while True:
            rec, lease = self._run(lambda conn: self._take(conn, sql, params), transaction=False)
            if rec is None or lease is not None:
                return lease
            if rec["id"] is None:
                # Spent attempts and dependents: dead-letter and cascade in one transaction.
                try:
                    lease = self._run(partial(self._claim_named, params={**params, "id": rec["candidate"]}))
                except (LeaseHeld, InvalidTransition, NotFound, TenantMismatch):
                    lease = None  # someone else settled it meanwhile
                if lease is not None:
                    return lease
            # The candidate was dead-lettered (its attempts were spent): claim the next one.

    def _take(self, conn: Conn, sql: str, params: Mapping[str, Any]) -> tuple[DictRow | None, Lease | None]:
        rec = self._one(conn, sql, params)
        if rec is None or rec["id"] is None:
            return rec, None
        if rec["state"] == WorkState.LEASED:
            return rec, make_lease(rec)
        if rec["has_dependents"]:
            self._cascade(conn, rec["id"], WorkState(rec["state"]))
        return rec, None

    def _claim_named(self, conn: Conn, params: Mapping[str, Any]) -> Lease | None:
        item_id = params["id"]
        for _ in range(2):
            rec, lease = self._take(conn, CLAIM_NAMED, params)
            if rec is not None:
                return lease
            if not check_named_claim(self._view(conn, item_id), item_id, params["tenant"]):
                return None
            # Claimable on the re-read: its lease expired between the two statements. Once more.
        return None

    # --- fenced calls --------------------------------------------------------------------------------------------

    def mark_running(self, lease: Lease) -> Lease:
        def run(conn: Conn) -> Lease:
            rec = self._one(conn, MARK_RUNNING, self._fence_params(lease))
            if rec is not None:
                return make_lease(rec)
            view = self._view(conn, lease.work_item_id)
            violation = fence_violation(view, lease)
            if violation is not None:
                raise violation
            # Already running under this very lease: nothing to do.
            rec = self._one(conn, SELECT_ITEM, {"id": lease.work_item_id})
            assert rec is not None
            return make_lease(rec)

        return self._run(run, transaction=False)

    def start_many(
        self, owner: str, claims: Sequence[tuple[str, str]], *, ttl_s: float | None = None
    ) -> dict[str, StartedTurn]:
        check_owner(owner)
        ttl = self.limits.ttl(ttl_s)
        wanted = distinct_claims(claims)
        if not wanted:
            return {}
        params = self._p(
            owner=owner, ttl=ttl, ids=[i for i, _ in wanted], tenants=[tenant for _, tenant in wanted]
        )
        rows = self._run(lambda conn: conn.execute(START_MANY, params).fetchall(), transaction=False)
        return {rec["id"]: StartedTurn(make_lease(rec), bytes(rec["payload"])) for rec in rows}

    def renew(self, lease: Lease, *, ttl_s: float | None = None) -> Lease:
        ttl = self.limits.ttl(ttl_s)

        def run(conn: Conn) -> Lease:
            rec = self._one(conn, RENEW, self._fence_params(lease, ttl=ttl))
            if rec is None:
                raise self._refused(conn, lease)
            return make_lease(rec)

        return self._run(run, transaction=False)

    def require_current(self, lease: Lease) -> None:
        violation = self._run(
            lambda conn: fence_violation(self._view(conn, lease.work_item_id), lease), transaction=False
        )
        if violation is not None:
            raise violation

    def commit(
        self,
        lease: Lease,
        outcome: Outcome,
        *,
        retryable: bool = False,
        error: str | None = None,
    ) -> CommitResult:
        outcome = Outcome(outcome)
        if outcome is Outcome.FAILED and retryable:
            item, repeated = self._retry(lease, error)
            return CommitResult(item, repeated=repeated)
        params = self._fence_params(
            lease, state=COMMIT_STATE[outcome].value, outcome=outcome.value, error=bound_error(error)
        )

        # Fast path: nobody depends on the item, so the one conditional UPDATE is the whole
        # transaction. Otherwise (or when refused) the transactional form decides and explains.
        fast = self._run(lambda conn: self._one(conn, COMMIT_FAST, params), transaction=False)
        if fast is not None:
            return CommitResult(make_item(fast))

        def run(conn: Conn) -> CommitResult:
            rec = self._one(conn, COMMIT, params)
            if rec is None:
                view = self._view(conn, lease.work_item_id)
                if repeated_commit(view, lease, outcome, retryable=False):
                    again = self._one(conn, SELECT_ITEM, {"id": lease.work_item_id})
                    assert again is not None
                    return CommitResult(make_item(again), repeated=True)
                raise self._refused(conn, lease)
            if rec["has_dependents"]:
                self._settle_dependents(conn, rec["id"], WorkState(rec["state"]))
            return CommitResult(make_item(rec))

        return self._run(run)

    def commit_many(self, commits: Sequence[tuple[Lease, Outcome, str | None]]) -> dict[str, WorkItem]:
        wanted = distinct_commits(commits)
        if not wanted:
            return {}
        params = self._p(
            ids=[lease.work_item_id for lease, _, _ in wanted],
            tenants=[lease.tenant for lease, _, _ in wanted],
            owners=[lease.owner for lease, _, _ in wanted],
            epochs=[lease.lease_epoch for lease, _, _ in wanted],
            tokens=[lease.fencing_token for lease, _, _ in wanted],
            states=[COMMIT_STATE[outcome].value for _, outcome, _ in wanted],
            outcomes=[outcome.value for _, outcome, _ in wanted],
            errors=[error for _, _, error in wanted],
        )
        rows = self._run(lambda conn: conn.execute(COMMIT_MANY, params).fetchall(), transaction=False)
        return {rec["id"]: make_item(rec) for rec in rows}

    def retry(self, lease: Lease, *, error: str | None = None) -> WorkItem:
        return self._retry(lease, error)[0]

    def _retry(self, lease: Lease, error: str | None) -> tuple[WorkItem, bool]:
        params = self._fence_params(lease, backoff=backoff_s(lease.attempt), error=bound_error(error))

        fast = self._run(lambda conn: self._one(conn, RETRY_FAST, params), transaction=False)
        if fast is not None:
            return make_item(fast), False

        def run(conn: Conn) -> tuple[WorkItem, bool]:
            rec = self._one(conn, RETRY, params)
            if rec is None:
                if repeated_commit(
                    self._view(conn, lease.work_item_id), lease, Outcome.FAILED, retryable=True
                ):
                    again = self._one(conn, SELECT_ITEM, {"id": lease.work_item_id})
                    assert again is not None
                    return make_item(again), True
                raise self._refused(conn, lease)
            if rec["state"] == WorkState.DEAD_LETTER and rec["has_dependents"]:
                self._cascade(conn, rec["id"], WorkState.DEAD_LETTER)
            return make_item(rec), False

        return self._run(run)

    def defer(self, lease: Lease, *, delay_s: float = 0.0) -> WorkItem:
        if delay_s < 0:
            raise InvalidRequest("delay_s must not be negative")
        params = self._fence_params(lease, delay=delay_s, detail=f"delay {delay_s:g}s" if delay_s else None)

        def run(conn: Conn) -> WorkItem:
            rec = self._one(conn, DEFER, params)
            if rec is None:
                raise self._refused(conn, lease)
            return make_item(rec)

        return self._run(run, transaction=False)

    # --- unfenced transitions ----------------------------------------------------------------------------------

    def cancel(self, work_item_id: str, *, tenant: str, reason: str) -> WorkItem:
        params = self._p(id=work_item_id, tenant=tenant, reason=bound_error(reason))

        def run(conn: Conn) -> WorkItem:
            rec = self._one(conn, CANCEL, params)
            if rec is None:
                view = self._view(conn, work_item_id)
                if view is None or view.tenant != tenant:
                    raise NotFound(f"work item {work_item_id} not found")
                raise InvalidTransition(f"work item {work_item_id} is already {view.state.value}")
            if rec["has_dependents"]:
                self._cascade(conn, work_item_id, WorkState.CANCELLED)
            return make_item(rec)

        return self._run(run)

    def dead_letter(self, work_item_id: str, *, reason: str) -> WorkItem:
        params = self._p(id=work_item_id, reason=bound_error(reason))

        def run(conn: Conn) -> WorkItem:
            rec = self._one(conn, DEAD_LETTER, params)
            if rec is None:
                view = self._view(conn, work_item_id)
                if view is None:
                    raise NotFound(f"work item {work_item_id} not found")
                raise InvalidTransition(f"work item {work_item_id} is already {view.state.value}")
            if rec["has_dependents"]:
                self._cascade(conn, work_item_id, WorkState.DEAD_LETTER)
            return make_item(rec)

        return self._run(run)

    def expire(self, *, limit: int = 1000) -> list[WorkItem]:
        def run(conn: Conn) -> list[WorkItem]:
            rows = conn.execute(EXPIRE, self._p(limit=limit)).fetchall()
            for rec in rows:
                if rec["has_dependents"]:
                    self._cascade(conn, rec["id"], WorkState.CANCELLED)
            return [make_item(rec) for rec in rows]

        return self._run(run)

    def mark_dispatched(self, work_item_ids: Sequence[str]) -> None:
        if not work_item_ids:
            return
        params = self._p(ids=list(work_item_ids))
        self._run(lambda conn: conn.execute(MARK_DISPATCHED, params), transaction=False)

    # --- dependencies ------------------------------------------------------------------------------------------

    def _settle_dependents(self, conn: Conn, parent: str, state: WorkState) -> None:
        if state is WorkState.SUCCEEDED:
            conn.execute(RELEASE, self._p(parent=parent))
        elif state in DEPENDENCY_FAILED:
            self._cascade(conn, parent, state)

    def _cascade(self, conn: Conn, root: str, state: WorkState) -> None:
        """Cancel dependents level by level, each level a statement that sees the one before."""
        frontier = [(root, state)]
        while frontier:
            parent, parent_state = frontier.pop()
            rows = conn.execute(
                CASCADE, self._p(parent=parent, reason=dependency_reason(parent, parent_state))
            ).fetchall()
            frontier.extend((rec["id"], WorkState(rec["state"])) for rec in rows if rec["has_dependents"])

    # --- leader election and lifecycle -----------------------------------------------------------------------

    def try_lead(self, name: str) -> bool:
        """``pg_try_advisory_lock`` on a dedicated connection, kept open (and the lock held) while leading."""
        with self._lock:
            held = self._leaders.get(name)
            if held is not None:
                try:
                    held.execute("SELECT 1")
                    return True
                except psycopg.Error:
                    # The session (and with it the lock) is gone; compete again like anyone else.
                    self._leaders.pop(name, None)
                    held.close()
            try:
                conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=10)
            except psycopg.OperationalError as exc:
                raise BackendUnavailable("PostgreSQL is unavailable for leader election") from exc
            # If this leader stalls (paused, partitioned) past the timeout, the server ends its session
            # and so releases the lock; a live leader keeps it with the SELECT 1 above every sweep.
            idle_ms = int(self.limits.leader_idle_timeout_s * 1000)
            conn.execute("SELECT set_config('idle_session_timeout', %s, false)", (f"{idle_ms}ms",))
            rec = conn.execute("SELECT pg_try_advisory_lock(%s)", (_leader_key(name),)).fetchone()
            if rec is not None and rec[0]:
                self._leaders[name] = conn
                return True
            conn.close()
            return False

    def close(self) -> None:
        with self._lock:
            leaders, self._leaders = self._leaders, {}
        for conn in leaders.values():
            conn.close()  # ends the session, which releases its advisory locks
        self._pool.close()
