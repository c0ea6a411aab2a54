"""Peers on the same PostgreSQL: each installed from its own registry into the cache, outside the repo.

Only our harness programs live in ``bench/peers/`` (they call each peer's public API: a no-op
job, its documented worker, its batch insert). Installing copies them next to the peer's
packages under ``~/.cache/agent-dispatch/bench/<peer>`` and builds or installs there; a peer that
cannot be installed is reported with the command and its error, and the run goes on without it.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench._common import CACHE, ROOT, SetupFailed, run_checked, say

HARNESS = ROOT / "bench" / "peers"

PROCRASTINATE = "procrastinate==3.10.0"
GRAPHILE_WORKER = "graphile-worker@0.18.0"
PG_BOSS = "pg-boss@12.38.0"
RIVER_MODULE = "github.com/riverqueue/river"
RIVER_VERSION = "v0.51.2"


#: How each peer is set up (the doc quotes these).
NOTES = {
    "procrastinate": "PsycopgConnector, schema_manager.apply_schema, async worker (run_worker_async, "
    "concurrency 4, LISTEN/NOTIFY on by default); batch_defer",
    "graphile-worker": "runMigrations, run() with a task list and concurrency 4 (LISTEN/NOTIFY); addJobs",
    "pg-boss": "start(), createQueue with notify (LISTEN/NOTIFY wake-ups), work() with localConcurrency 4, "
    "batchSize 10 and burstWhenBatchFull, its documented throughput options (with the defaults, "
    "batchSize 1 and a 2 s poll, it runs about 2 jobs/s); insert()",
    "River": "riverpgxv5 driver, rivermigrate, the default queue with MaxWorkers 100 as in its quick "
    "start (with 4, its 100 ms fetch cooldown caps it near 40 jobs/s); InsertMany",
}


@dataclass(frozen=True)
class Peer:
    """How to drive one peer: ``<prefix> setup|work|insert DSN ...`` (see bench/peers/)."""

    name: str
    version: str
    prefix: tuple[str, ...]
    cwd: Path
    #: Jobs not finished yet, on the peer's own tables.
    remaining_sql: str
    notes: str
    #: Workers per process when the peer's quick start sets it (else CONCURRENCY, as ours).
    concurrency: int | None = None


@dataclass(frozen=True)
class Unavailable:
    name: str
    command: str
    error: str


def _copy(src: Path, dst_dir: Path, name: str | None = None) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / (name or src.name)
    shutil.copyfile(src, dst)
    return dst


def procrastinate() -> Peer:
    root = CACHE / "procrastinate"
    python = root / "venv" / "bin" / "python"
    if not python.exists():
        run_checked([sys.executable, "-m", "venv", str(root / "venv")])
    run_checked([str(python), "-m", "pip", "install", "-q", PROCRASTINATE, "psycopg[binary]"])
    version = run_checked([str(python), "-c", "import procrastinate; print(procrastinate.__version__)"])
    script = _copy(HARNESS / "procrastinate_bench.py", root)
    return Peer(
        "procrastinate",
        version.strip(),
        (str(python), str(script)),
        root,
        "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')",
        NOTES["procrastinate"],
    )


def _node_modules() -> Path:
    root = CACHE / "node"
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "package.json").exists():
        (root / "package.json").write_text('{"name": "agent-dispatch-bench-peers", "private": true}\n')
    return root


def _npm(package: str) -> Path:
    root = _node_modules()
    name = package.rsplit("@", 1)[0]
    installed = root / "node_modules" / name / "package.json"
    wanted = package.rsplit("@", 1)[1]
    if not installed.exists() or f'"version": "{wanted}"' not in installed.read_text():
        run_checked(["npm", "install", "--no-audit", "--no-fund", package], cwd=root)
    return root


def graphile_worker() -> Peer:
    root = _npm(GRAPHILE_WORKER)
    script = _copy(HARNESS / "graphile_worker_bench.mjs", root)
    return Peer(
        "graphile-worker",
        GRAPHILE_WORKER.rsplit("@", 1)[1],
        ("node", str(script)),
        root,
        "SELECT count(*) FROM graphile_worker._private_jobs",
        NOTES["graphile-worker"],
    )


def pg_boss() -> Peer:
    root = _npm(PG_BOSS)
    script = _copy(HARNESS / "pg_boss_bench.mjs", root)
    return Peer(
        "pg-boss",
        PG_BOSS.rsplit("@", 1)[1],
        ("node", str(script)),
        root,
        "SELECT count(*) FROM pgboss.job WHERE state IN ('created', 'retry', 'active')",
        NOTES["pg-boss"],
    )


def river() -> Peer:
    from testenv._common import go_env

    root = CACHE / "river"
    root.mkdir(parents=True, exist_ok=True)
    env = go_env()
    _copy(HARNESS / "river_main.go", root, "main.go")
    binary = root / "river-bench"
    if not (root / "go.mod").exists():
        run_checked(["go", "mod", "init", "riverbench"], cwd=root, env=env)
    run_checked(
        [
            "go",
            "get",
            f"{RIVER_MODULE}@{RIVER_VERSION}",
            f"{RIVER_MODULE}/riverdriver/riverpgxv5@{RIVER_VERSION}",
            "github.com/jackc/pgx/v5",
        ],
        cwd=root,
        env=env,
    )
    run_checked(["go", "mod", "tidy"], cwd=root, env=env)
    run_checked(["go", "build", "-o", str(binary), "."], cwd=root, env=env)
    return Peer(
        "River",
        RIVER_VERSION,
        (str(binary),),
        root,
        "SELECT count(*) FROM river_job WHERE state NOT IN ('completed', 'cancelled', 'discarded')",
        NOTES["River"],
        concurrency=100,
    )


INSTALLERS = {
    "procrastinate": procrastinate,
    "graphile-worker": graphile_worker,
    "pg-boss": pg_boss,
    "River": river,
}


def install(names: list[str] | None = None) -> tuple[list[Peer], list[Unavailable]]:
    peers: list[Peer] = []
    missing: list[Unavailable] = []
    for name, installer in INSTALLERS.items():
        if names is not None and name not in names:
            continue
        say(f"installing peer {name}")
        try:
            peers.append(installer())
        except SetupFailed as exc:
            missing.append(Unavailable(name, exc.command, exc.output))
        except OSError as exc:  # e.g. node or go missing from the machine
            missing.append(Unavailable(name, name, f"{type(exc).__name__}: {exc}"))
    return peers, missing
