"""SQLite's database is private to a process's data directory (a worker pod's emptyDir): every
entry point brings its schema up to date itself (found by running worker pods, whose sweep failed
with "run agent-dispatch migrate" that nothing could run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_dispatch.runtime import open_runtime
from agent_dispatch.settings import load


def test_a_fresh_sqlite_data_dir_is_migrated_on_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASK_QUEUE_BACKEND", "sqlite")
    monkeypatch.setenv("AGENT_DISPATCH_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("AGENT_DISPATCH_SIGNING_KEY", "k" * 40)
    monkeypatch.delenv("STATE_DB_URI", raising=False)
    runtime = open_runtime(load())
    try:
        assert runtime.store.expire() == []  # raised SchemaOutdated before
        assert runtime.store.migrate() >= 1  # already current: a no-op that reports the version
    finally:
        runtime.close()
