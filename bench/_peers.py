"""Peers on the same PostgreSQL: each installed from its own registry into the cache, outside the repo.

Only our harness programs live in ``bench/peers/`` (they call each peer's public API: a no-op
job, its documented worker, its batch insert). Every peer runs at two settings in the same rounds:
the fairness setting (CONCURRENCY workers per process, as ours, unless its quick start says
otherwise) and its own documented throughput settings (``work DSN WORKERS fair|throughput``).
Installing copies them next to the peer's packages under ``~/.cache/agent-dispatch/bench/<peer>``
and builds or installs there; a peer that cannot be installed is reported with the command and
its error, and the run goes on without it.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench._common import CACHE, CONCURRENCY, ROOT, SetupFailed, run_checked, say

HARNESS = ROOT / "bench" / "peers"

PROCRASTINATE = "procrastinate==3.10.0"
GRAPHILE_WORKER = "graphile-worker@0.18.0"
PG_BOSS = "pg-boss@12.38.0"
RIVER_MODULE = "github.com/riverqueue/river"
RIVER_VERSION = "v0.51.2"


#: The two settings every peer runs at, in the same interleaved rounds.
FAIR = "fair"
THROUGHPUT = "throughput"
#: How a peer's rows are named at each setting (its plain name is the fairness setting).
LABELS = {FAIR: "{name}", THROUGHPUT: "{name} (its throughput settings)"}

#: Workers per process at each setting: at the fairness setting CONCURRENCY, as ours, except where
#: a peer's quick start sets it; at the throughput setting what the peer's docs use for throughput.
WORKERS: dict[str, dict[str, int]] = {
    "procrastinate": {FAIR: CONCURRENCY, THROUGHPUT: 30},
    "graphile-worker": {FAIR: CONCURRENCY, THROUGHPUT: 24},
    "pg-boss": {FAIR: CONCURRENCY, THROUGHPUT: CONCURRENCY},
    "River": {FAIR: 100, THROUGHPUT: 2000},
}

#: How each peer is set up at each setting, with the documentation each throughput option comes
#: from (paths in the peer's own repository or on its documentation site). The doc quotes these.
NOTES: dict[str, dict[str, str]] = {
    "procrastinate": {
        FAIR: "PsycopgConnector, schema_manager.apply_schema, async worker (run_worker_async, "
        "concurrency 4, LISTEN/NOTIFY on by default); batch_defer",
        THROUGHPUT: "run_worker_async with concurrency 30, per its docs (docs/howto/production/concurrency.md, "
        "its way to raise throughput), and a connection pool of concurrency + 1 (PsycopgConnector "
        'max_size 31), per its docs for short jobs (docs/discussions.md, "Mind the size of your '
        'PostgreSQL pool"); LISTEN/NOTIFY and the 5 s fetch_job_polling_interval left at its defaults; '
        "batch_defer as at the fairness setting",
    },
    "graphile-worker": {
        FAIR: "runMigrations, run() with a task list and concurrency 4 (LISTEN/NOTIFY); addJobs",
        THROUGHPUT: "run() with the preset its throughput figures were measured with, per its docs "
        '(website/docs/performance.md, "Quick stats"): concurrentJobs 24, maxPoolSize 25, localQueue '
        'size 500 (batched fetching, off by default; same page, "Batching") and completeJobBatchDelay / '
        "failJobBatchDelay 0 (batched completion, off by default); addJobs as at the fairness setting",
    },
    "pg-boss": {
        FAIR: "start(), createQueue with notify plus the instance's useListenNotify (both are needed for "
        "LISTEN/NOTIFY wake-ups), work() with localConcurrency 4, batchSize 10 and burstWhenBatchFull "
        "(with the defaults, batchSize 1 and a 2 s poll, it runs about 2 jobs/s); insert()",
        THROUGHPUT: "the options its docs give for throughput, per its docs (docs/api/workers.md, which "
        "names no figures): LISTEN/NOTIFY (useListenNotify, docs/api/constructor.md, with the queue's "
        'notify; docs/api/workers.md, "Low-latency dispatch with LISTEN/NOTIFY"), burstWhenBatchFull '
        "(fetch again at once while batches come back full) and batchSize 100 (the size is ours: one "
        "submitted batch per fetch), with localConcurrency 4 and its default pool (max 10); insert() as at "
        "the fairness setting",
    },
    "River": {
        FAIR: "riverpgxv5 driver, rivermigrate, the default queue with MaxWorkers 100 as in its quick "
        "start (with 4, its 100 ms fetch cooldown caps it near 40 jobs/s); InsertMany",
        THROUGHPUT: "the settings its own benchmark runs with, per its docs (docs/benchmarks on its "
        "documentation site: 2,000 worker goroutines, through its `river bench` command, whose source "
        "cmd/river/riverbench/river_bench.go sets the rest): MaxWorkers 2000, FetchCooldown 2 ms (100 ms "
        'by default; its Config docs in client.go: "Throughput is limited by this value") and '
        "FetchPollInterval 20 ms (1 s by default); InsertMany as at the fairness setting",
    },
}


@dataclass(frozen=True)
class Setting:
    """One of a peer's two settings: the harness's ``work`` command gets ``key`` and ``workers``."""

    key: str
    #: The system's name in results and tables.
    label: str
    workers: int
    notes: str


def settings(name: str) -> tuple[Setting, ...]:
    return tuple(
        Setting(key, LABELS[key].format(name=name), WORKERS[name][key], NOTES[name][key])
        for key in (FAIR, THROUGHPUT)
    )


@dataclass(frozen=True)
class Peer:
    """How to drive one peer: ``<prefix> setup|work|insert DSN ...`` (see bench/peers/)."""

    name: str
    version: str
    prefix: tuple[str, ...]
    cwd: Path
    #: Jobs not finished yet, on the peer's own tables.
    remaining_sql: str
    #: The fairness setting and the peer's documented throughput settings, run in the same rounds.
    settings: tuple[Setting, ...]


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
        settings("procrastinate"),
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
        settings("graphile-worker"),
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
        settings("pg-boss"),
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
        settings("River"),
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
