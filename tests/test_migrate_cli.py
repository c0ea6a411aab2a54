"""``agent-dispatch migrate`` creates the WorkItem schema of the configured store and says its version."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_dispatch.cli import main
from agent_dispatch.settings import load
from agent_dispatch.store import SCHEMA_VERSION
from agent_dispatch.stores import open_store


def _clean_env(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    for name in ("STATE_DB_URI", "TASK_QUEUE_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGENT_DISPATCH_DATA_DIR", str(data_dir))


def test_migrate_creates_the_sqlite_schema(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch, tmp_path)
    assert main(["migrate"]) == 0
    assert main(["migrate"]) == 0  # idempotent
    out = capsys.readouterr().out
    assert f"WorkItem schema on sqlite is at version {SCHEMA_VERSION}" in out
    store = open_store(load())
    try:
        assert store.list_items(tenant="t") == []  # usable: the schema is current
    finally:
        store.close()


@pytest.mark.postgres
def test_migrate_creates_the_postgres_schema(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, postgres_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch, tmp_path)
    monkeypatch.setenv("STATE_DB_URI", postgres_dsn)
    assert main(["migrate"]) == 0
    assert f"WorkItem schema on postgres is at version {SCHEMA_VERSION}" in capsys.readouterr().out


def test_migrate_against_an_unreachable_database_exits_3(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch, tmp_path)
    monkeypatch.setenv("STATE_DB_URI", "postgresql://nobody:secret-pw@127.0.0.1:1/none")
    assert main(["migrate"]) == 3
    err = capsys.readouterr().err
    assert "unreachable" in err
    assert "secret-pw" not in err
