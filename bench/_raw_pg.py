"""The PostgreSQL raw ceiling: the minimal SQL for a fenced turn, in a bare psycopg loop.

Per turn: one INSERT (the work item and its queue row, one statement), one claim that leases the
item (next queued row, ``FOR UPDATE SKIP LOCKED``, epoch + 1, a fencing token from a sequence, a
lease expiry), a no-op, and one fenced commit that also deletes the queue row (the
acknowledgement). Three statements, autocommit, no pool, no envelope, no fairness.

    python -m bench._raw_pg setup  DSN
    python -m bench._raw_pg work   DSN THREADS      (prints "ready"; runs until SIGTERM)
    python -m bench._raw_pg insert DSN COUNT BATCH  (prints "start <unix time>" first)
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import psycopg

SCHEMA = """
CREATE SEQUENCE IF NOT EXISTS raw_fence;
CREATE TABLE IF NOT EXISTS raw_item (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant text NOT NULL,
    state text NOT NULL,
    payload bytea NOT NULL,
    lease_owner text,
    lease_epoch bigint NOT NULL DEFAULT 0,
    fencing_token bigint NOT NULL DEFAULT 0,
    lease_expires_at timestamptz
);
CREATE TABLE IF NOT EXISTS raw_queue (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    item_id bigint NOT NULL,
    claimed_by text
);
CREATE INDEX IF NOT EXISTS raw_queue_ready ON raw_queue (id) WHERE claimed_by IS NULL;
"""

INSERT = """
WITH i AS (INSERT INTO raw_item (tenant, state, payload) VALUES (%s, 'ready', %s) RETURNING id)
INSERT INTO raw_queue (item_id) SELECT id FROM i
"""

CLAIM = """
WITH q AS (
    SELECT id, item_id FROM raw_queue WHERE claimed_by IS NULL ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED
), c AS (
    UPDATE raw_queue SET claimed_by = %(owner)s FROM q WHERE raw_queue.id = q.id RETURNING q.id, q.item_id
)
UPDATE raw_item i
   SET state = 'running', lease_owner = %(owner)s, lease_epoch = lease_epoch + 1,
       fencing_token = nextval('raw_fence'), lease_expires_at = now() + interval '120 seconds'
  FROM c
 WHERE i.id = c.item_id
RETURNING c.id, i.id, i.lease_epoch, i.fencing_token, i.payload
"""

COMMIT_ACK = """
WITH done AS (
    UPDATE raw_item SET state = 'succeeded', lease_expires_at = NULL
     WHERE id = %(item)s AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
       AND fencing_token = %(token)s AND lease_expires_at > now()
    RETURNING id
)
DELETE FROM raw_queue WHERE id = %(queue)s AND claimed_by = %(owner)s AND EXISTS (SELECT 1 FROM done)
"""

REMAINING = "SELECT count(*) FROM raw_item WHERE state <> 'succeeded'"


def setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)


def work(dsn: str, threads: int) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def loop(n: int) -> None:
        owner = f"raw-{n}"
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                row = conn.execute(CLAIM, {"owner": owner}).fetchone()
                if row is None:
                    time.sleep(0.005)
                    continue
                queue_id, item_id, epoch, token, _payload = row
                # the no-op turn
                conn.execute(
                    COMMIT_ACK,
                    {"item": item_id, "owner": owner, "epoch": epoch, "token": token, "queue": queue_id},
                )

    pool = [threading.Thread(target=loop, args=(n,), daemon=True) for n in range(threads)]
    for t in pool:
        t.start()
    print("ready", flush=True)
    stop.wait()
    for t in pool:
        t.join(5)


def insert(dsn: str, count: int, batch: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT 1")
        print(f"start {time.time():.6f}", flush=True)
        with conn.cursor() as cur:
            for done in range(0, count, batch):
                n = min(batch, count - done)
                # One statement per turn (as enqueue_many's one transaction per turn), pipelined.
                cur.executemany(INSERT, [(f"tenant-{(done + i) % 100}", b"{}") for i in range(n)])


def main(argv: list[str]) -> None:
    command, dsn, *rest = argv
    if command == "setup":
        setup(dsn)
    elif command == "work":
        work(dsn, int(rest[0]))
    elif command == "insert":
        insert(dsn, int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv[1:])
