"""The SQLite raw ceiling: the minimal statements for a fenced turn, in a bare sqlite3 loop.

Same shape as :mod:`bench._raw_pg`, on one WAL-mode file: one INSERT per turn (item and queue row,
one transaction), a claim that leases the item (``BEGIN IMMEDIATE``, next queue row, epoch + 1, a
fencing token), a no-op, and a fenced commit that deletes the queue row, in one transaction.

    python -m bench._raw_sqlite setup  PATH
    python -m bench._raw_sqlite work   PATH THREADS      (prints "ready"; runs until SIGTERM)
    python -m bench._raw_sqlite insert PATH COUNT BATCH  (prints "start <unix time>" first)
"""

from __future__ import annotations

import signal
import sqlite3
import sys
import threading
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS raw_item (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    state TEXT NOT NULL,
    payload BLOB NOT NULL,
    lease_owner TEXT,
    lease_epoch INTEGER NOT NULL DEFAULT 0,
    fencing_token INTEGER NOT NULL DEFAULT 0,
    lease_expires_at REAL
);
CREATE TABLE IF NOT EXISTS raw_queue (id INTEGER PRIMARY KEY, item_id INTEGER NOT NULL, claimed_by TEXT);
CREATE INDEX IF NOT EXISTS raw_queue_ready ON raw_queue (id) WHERE claimed_by IS NULL;
CREATE TABLE IF NOT EXISTS raw_fence (singleton INTEGER PRIMARY KEY CHECK (singleton = 1), token INTEGER NOT NULL);
INSERT OR IGNORE INTO raw_fence VALUES (1, 0);
"""

REMAINING = "SELECT count(*) FROM raw_item WHERE state <> 'succeeded'"


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def setup(path: str) -> None:
    with connect(path) as conn:
        conn.executescript(SCHEMA)


def work(path: str, threads: int) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def loop(n: int) -> None:
        owner = f"raw-{n}"
        conn = connect(path)
        while not stop.is_set():
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute(
                "UPDATE raw_queue SET claimed_by = ? WHERE id = "
                "(SELECT id FROM raw_queue WHERE claimed_by IS NULL ORDER BY id LIMIT 1) RETURNING id, item_id",
                (owner,),
            ).fetchone()
            if row is None:
                conn.execute("COMMIT")
                time.sleep(0.005)
                continue
            queue_id, item_id = row
            token = conn.execute("UPDATE raw_fence SET token = token + 1 RETURNING token").fetchone()[0]
            epoch, _payload = conn.execute(
                "UPDATE raw_item SET state = 'running', lease_owner = ?, lease_epoch = lease_epoch + 1,"
                " fencing_token = ?, lease_expires_at = ? WHERE id = ? RETURNING lease_epoch, payload",
                (owner, token, time.time() + 120, item_id),
            ).fetchone()
            conn.execute("COMMIT")
            # the no-op turn
            conn.execute("BEGIN IMMEDIATE")
            done = conn.execute(
                "UPDATE raw_item SET state = 'succeeded', lease_expires_at = NULL WHERE id = ? AND lease_owner = ?"
                " AND lease_epoch = ? AND fencing_token = ? AND lease_expires_at > ?",
                (item_id, owner, epoch, token, time.time()),
            ).rowcount
            if done:
                conn.execute("DELETE FROM raw_queue WHERE id = ? AND claimed_by = ?", (queue_id, owner))
            conn.execute("COMMIT")
        conn.close()

    pool = [threading.Thread(target=loop, args=(n,), daemon=True) for n in range(threads)]
    for t in pool:
        t.start()
    print("ready", flush=True)
    stop.wait()
    for t in pool:
        t.join(5)


def insert(path: str, count: int, batch: int) -> None:
    conn = connect(path)
    print(f"start {time.time():.6f}", flush=True)
    for i in range(count):
        conn.execute("BEGIN IMMEDIATE")
        item = conn.execute(
            "INSERT INTO raw_item (tenant, state, payload) VALUES (?, 'ready', ?)",
            (f"tenant-{i % 100}", b"{}"),
        ).lastrowid
        conn.execute("INSERT INTO raw_queue (item_id) VALUES (?)", (item,))
        conn.execute("COMMIT")
    conn.close()


def main(argv: list[str]) -> None:
    command, path, *rest = argv
    if command == "setup":
        setup(path)
    elif command == "work":
        work(path, int(rest[0]))
    elif command == "insert":
        insert(path, int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv[1:])
