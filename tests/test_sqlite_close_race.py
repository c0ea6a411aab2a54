"""Closing a SQLite database while other threads use it refuses their next call, and never
crashes the process (sqlite3 closing a connection under a running statement is a SIGSEGV)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# Run in a child process: a crash there is a return code here, not the end of the test session.
CHILD = textwrap.dedent(
    """
    import sqlite3, sys, threading, time
    from agent_dispatch.db.sqlite import ThreadConnections
    from agent_dispatch.errors import BackendUnavailable

    path, threads, delay_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    db = ThreadConnections(path, "test database")
    with db.transaction() as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    refused, wrong = [], []
    started = threading.Barrier(threads + 1)

    def hammer():
        started.wait()
        while True:
            try:
                with db.transaction() as conn:
                    conn.execute("INSERT INTO t VALUES (1)")
                    conn.execute("SELECT count(*) FROM t").fetchone()
                with db.use() as conn:
                    conn.execute("SELECT max(x) FROM t").fetchone()
            except BackendUnavailable:
                refused.append(1)
                return
            except sqlite3.Error as exc:  # e.g. "Cannot operate on a closed database"
                wrong.append(repr(exc))
                return

    workers = [threading.Thread(target=hammer) for _ in range(threads)]
    for w in workers:
        w.start()
    started.wait()
    time.sleep(delay_ms / 1000)
    db.close()
    for w in workers:
        w.join(30)
    print(len(refused), len(wrong), wrong[:1])
    """
)


@settings(max_examples=15, deadline=None)
@given(threads=st.integers(min_value=1, max_value=6), delay_ms=st.floats(min_value=0, max_value=20))
def test_close_under_running_statements_refuses_them_and_never_crashes(
    tmp_path_factory: pytest.TempPathFactory, threads: int, delay_ms: float
) -> None:
    path = tmp_path_factory.mktemp("close-race") / "db.sqlite"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(threads), str(delay_ms)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    refused, wrong, _ = proc.stdout.split(" ", 2)
    # Every thread ends by being refused, none by meeting a closed connection.
    assert (int(refused), int(wrong)) == (threads, 0), proc.stdout
