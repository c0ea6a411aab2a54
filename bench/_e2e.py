"""End-to-end turns per second: N turns submitted while K idle worker processes run them.

Every system is driven the same way, by a *driver*: a fresh database (or file, or topic), its
schema set up its own way, K worker processes of CONCURRENCY each started and waited for, a
warm-up batch run through them, then a separate inserter process submits N turns in batches of
BATCH while the workers run. The figure is N / (time from the inserter's first submit until the
last turn is finished, as the system's own tables say). Submitting is part of the figure, as it
is part of a turn's life; the inserter competes with the workers for the same two cores.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sqlite3
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench._common import (
    BASE_ENV,
    BATCH,
    CONCURRENCY,
    KEY,
    ROOT,
    Poller,
    Proc,
    machine_busy_seconds,
    python_cmd,
    say,
    spawn,
    wait_drained,
)
from bench._peers import Peer, Setting

WARMUP = 50


class Driver(Protocol):
    name: str
    backend: str

    def prepare(self) -> None: ...
    def start_worker(self, index: int, log_dir: Path) -> Proc: ...
    def wait_ready(self, proc: Proc) -> None: ...
    def start_inserter(self, count: int, log_dir: Path, tag: str) -> Proc: ...
    def remaining(self) -> int: ...
    def cleanup(self) -> None: ...


@dataclass
class Databases:
    """Fresh databases on the benchmark's PostgreSQL server."""

    server: Any  # testenv.postgres.PostgresServer
    created: list[str] = field(default_factory=list)

    def fresh(self, prefix: str) -> tuple[str, str]:
        name = re.sub(r"[^a-z0-9_]", "_", f"{prefix}_{uuid.uuid4().hex[:8]}".lower())
        dsn = self.server.create_database(name)
        self.created.append(name)
        return name, dsn

    def drop(self, name: str) -> None:
        with contextlib.suppress(Exception):
            self.server.drop_database(name)


class CommandDriver:
    """A peer or a raw loop: ``<prefix> setup|work|insert DSN ...`` (see bench/peers/)."""

    def __init__(
        self,
        name: str,
        prefix: tuple[str, ...],
        cwd: Path,
        remaining_sql: str,
        dbs: Databases,
        backend: str = "postgres",
        concurrency: int = CONCURRENCY,
        setting: str | None = None,
    ) -> None:
        self.name = name
        self.concurrency = concurrency
        #: The peer's setting, passed to its ``work`` command (raw loops have none).
        self.setting = setting
        #: The name as it can go into a log file's or a database's name.
        self.tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")
        self.backend = backend
        self.prefix = prefix
        self.cwd = cwd
        self.remaining_sql = remaining_sql
        self.dbs = dbs
        self.db = ""
        self.dsn = ""
        self._poller: Poller | None = None

    @classmethod
    def for_peer(cls, peer: Peer, setting: Setting, dbs: Databases) -> CommandDriver:
        return cls(
            setting.label,
            peer.prefix,
            peer.cwd,
            peer.remaining_sql,
            dbs,
            concurrency=setting.workers,
            setting=setting.key,
        )

    def prepare(self) -> None:
        from bench._common import run_checked

        self.db, self.dsn = self.dbs.fresh(f"e2e_{self.tag}"[:40])
        run_checked([*self.prefix, "setup", self.dsn], cwd=self.cwd, env=BASE_ENV, timeout=300)
        self._poller = Poller(self.dsn, self.remaining_sql)

    def start_worker(self, index: int, log_dir: Path) -> Proc:
        return spawn(
            f"{self.tag}-worker-{index}",
            [
                *self.prefix,
                "work",
                self.dsn,
                str(self.concurrency),
                *([self.setting] if self.setting else []),
            ],
            env=BASE_ENV,
            log_dir=log_dir,
            cwd=self.cwd,
        )

    def wait_ready(self, proc: Proc) -> None:
        proc.wait_line("ready", 120)

    def start_inserter(self, count: int, log_dir: Path, tag: str) -> Proc:
        return spawn(
            f"{self.tag}-insert-{tag}",
            [*self.prefix, "insert", self.dsn, str(count), str(BATCH)],
            env=BASE_ENV,
            log_dir=log_dir,
            cwd=self.cwd,
        )

    def remaining(self) -> int:
        assert self._poller is not None
        return self._poller.remaining()

    def cleanup(self) -> None:
        if self._poller is not None:
            self._poller.close()
            self._poller = None
        self.dbs.drop(self.db)


class SqliteRawDriver(CommandDriver):
    def __init__(self) -> None:
        super().__init__(
            "raw sqlite3", tuple(python_cmd("-m", "bench._raw_sqlite")), ROOT, "", None, backend="sqlite"
        )  # type: ignore[arg-type]
        self.tmp: Path | None = None

    def prepare(self) -> None:
        from bench._common import run_checked

        self.tmp = Path(tempfile.mkdtemp(prefix="agent-dispatch-bench-"))
        self.dsn = str(self.tmp / "raw.db")
        run_checked([*self.prefix, "setup", self.dsn], cwd=ROOT, env=BASE_ENV)

    def remaining(self) -> int:
        from bench._raw_sqlite import REMAINING

        with contextlib.closing(sqlite3.connect(self.dsn, timeout=30)) as conn:
            return int(conn.execute(REMAINING).fetchone()[0])

    def cleanup(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


class OursDriver:
    """agent-dispatch itself: ``agent-dispatch worker`` processes, ``enqueue_many`` submitter."""

    REMAINING = "SELECT count(*) FROM agent_dispatch_work_items WHERE state IN ('submitted', 'ready', 'leased', 'running')"

    def __init__(self, backend: str, dbs: Databases | None, bootstrap: str | None = None) -> None:
        self.name = "agent-dispatch"
        self.backend = backend
        self.dbs = dbs
        self.bootstrap = bootstrap
        self.env: dict[str, str] = {}
        self.db = ""
        self.tmp: Path | None = None
        self._poller: Poller | None = None
        self._sqlite: Path | None = None
        self._ports: dict[int, int] = {}

    def prepare(self) -> None:
        from agent_dispatch.stores import open_store
        from agent_dispatch.transports import open_transport

        self.tmp = Path(tempfile.mkdtemp(prefix="agent-dispatch-bench-"))
        env = {
            **BASE_ENV,
            "PYTHONPATH": str(ROOT),
            "AGENT_DISPATCH_SIGNING_KEY": KEY,
            "AGENT_DISPATCH_DATA_DIR": str(self.tmp),
            "AGENT_DISPATCH_LOG_LEVEL": "WARNING",
            "AGENT_DISPATCH_EXECUTOR": "noop",
            "AGENT_DISPATCH_CONCURRENCY": str(CONCURRENCY),
            "AGENT_DISPATCH_MAX_DEPTH": "10000000",
            "TASK_QUEUE_BACKEND": self.backend,
        }
        if self.backend in ("postgres", "kafka"):
            assert self.dbs is not None
            self.db, dsn = self.dbs.fresh(f"e2e_ours_{self.backend}")
            env["STATE_DB_URI"] = dsn
        if self.backend == "kafka":
            assert self.bootstrap is not None
            tag = uuid.uuid4().hex[:8]
            env.update(
                KAFKA_BOOTSTRAP_SERVERS=self.bootstrap,
                AGENT_DISPATCH_KAFKA_TOPIC=f"bench.e2e.{tag}",
                AGENT_DISPATCH_KAFKA_GROUP=f"bench-{tag}",
                AGENT_TURNS_PARTITIONS=str(2 * CONCURRENCY),
            )
        self.env = env
        settings = self._settings()
        store = open_store(settings)
        store.migrate()
        transport = open_transport(settings)
        transport.close()
        store.close()
        if self.backend == "sqlite":
            self._sqlite = settings.sqlite_path
        else:
            self._poller = Poller(env["STATE_DB_URI"], self.REMAINING)

    def _settings(self) -> Any:
        """The workers' configuration, loaded in-process from the same variables."""
        import os

        from agent_dispatch.settings import load

        saved = dict(os.environ)
        try:
            os.environ.clear()
            os.environ.update(self.env)
            return load()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def start_worker(self, index: int, log_dir: Path) -> Proc:
        from testenv._common import free_port

        port = free_port()
        proc = spawn(
            f"ours-{self.backend}-worker-{index}",
            python_cmd("-m", "agent_dispatch.cli", "worker"),
            env={**self.env, "AGENT_DISPATCH_METRICS_PORT": str(port)},
            log_dir=log_dir,
        )
        self._ports[proc.pid] = port
        return proc

    def wait_ready(self, proc: Proc) -> None:
        port = self._ports[proc.pid]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited {proc.popen.returncode}:\n{proc.tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{proc.name} not ready within 120s:\n{proc.tail()}")

    def start_inserter(self, count: int, log_dir: Path, tag: str) -> Proc:
        return spawn(
            f"ours-{self.backend}-insert-{tag}",
            python_cmd("-m", "bench._ours", "insert", str(count), str(BATCH)),
            env={**self.env, "AGENT_DISPATCH_METRICS_PORT": "0"},
            log_dir=log_dir,
        )

    def remaining(self) -> int:
        if self._sqlite is not None:
            with contextlib.closing(sqlite3.connect(self._sqlite, timeout=30)) as conn:
                return int(conn.execute(self.REMAINING).fetchone()[0])
        assert self._poller is not None
        return self._poller.remaining()

    def cleanup(self) -> None:
        if self._poller is not None:
            self._poller.close()
            self._poller = None
        if self.dbs is not None and self.db:
            self.dbs.drop(self.db)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


@dataclass(frozen=True)
class Measured:
    """One run's figures."""

    rate: float  # turns/s, the inserter's first submit until the last turn finished
    submit_rate: float  # turns/s, the inserter's first submit until it exited
    cpu_ms_per_turn: float  # the whole machine's busy CPU in that window, per turn


def measure(driver: Driver, *, processes: int, count: int, log_dir: Path) -> Measured:
    """One run: turns per second for ``count`` turns through ``processes`` worker processes, the
    submission rate alone, and the CPU the whole machine spent per turn meanwhile (the inserter,
    the workers, the database and the kernel alike: what a turn costs, whoever pays it)."""
    driver.prepare()
    workers: list[Proc] = []
    try:
        workers = [driver.start_worker(i, log_dir) for i in range(processes)]
        for proc in workers:
            driver.wait_ready(proc)
        timeout = max(180.0, count / 10)
        warm = driver.start_inserter(WARMUP, log_dir, "warmup")
        wait_drained(driver.remaining, warm, timeout=timeout)
        inserter = driver.start_inserter(count, log_dir, "timed")
        start = float(inserter.wait_line("start ", 120).split()[1])
        busy = machine_busy_seconds()
        end = wait_drained(driver.remaining, inserter, timeout=timeout)
        cpu_ms = 1000 * (machine_busy_seconds() - busy) / count
        return Measured(count / (end - start), count / max(inserter.exited_at - start, 1e-9), cpu_ms)
    finally:
        for proc in workers:
            proc.stop()
        driver.cleanup()


def kafka_raw(bootstrap: str, count: int) -> float:
    """The bare confluent-kafka loop of bench/kafka_bench.py: produce, consume, commit per batch."""
    from bench.kafka_bench import Bench, make_turns

    bench = Bench(bootstrap, 2 * CONCURRENCY)
    try:
        return bench.e2e_raw(make_turns(count))
    finally:
        bench.cleanup()


def kafka_raw_with_store(bootstrap: str, dsn: str, count: int) -> float:
    """The bare loop plus the WorkItem writes the design requires (bench/_raw_kafka_store.py)."""
    from bench import _raw_kafka_store
    from bench.kafka_bench import Bench, make_turns, producer_config

    bench = Bench(bootstrap, 2 * CONCURRENCY)
    try:
        wires = [turn.wire for turn in make_turns(count)]
        return _raw_kafka_store.run(
            bootstrap, bench.topic("e2e-raw-store"), dsn, wires, producer_config(bootstrap)
        )
    finally:
        bench.cleanup()


def run_rounds(
    drivers: list[tuple[str, Callable[[], Driver]]],
    *,
    processes: list[int],
    count: int,
    rounds: int,
    log_dir: Path,
    record: Callable[[str, int, float | None, str | None, float | None, float | None], None],
) -> None:
    """Interleave systems within each round, so drift on a busy machine hits all of them alike."""
    for round_no in range(1, rounds + 1):
        for k in processes:
            for label, make in drivers:
                try:
                    driver = make()
                    got = measure(driver, processes=k, count=count, log_dir=log_dir)
                except Exception as exc:  # one failed run is reported, not fatal to the benchmark
                    say(f"round {round_no}: {label} x{k}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    record(
                        label, k, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", None, None
                    )
                    continue
                say(
                    f"round {round_no}: {label:<28} {k} proc: {got.rate:8.1f} turns/s (submitting alone "
                    f"{got.submit_rate:8.1f}/s; {got.cpu_ms_per_turn:.3f} ms of CPU a turn)"
                )
                record(label, k, got.rate, None, got.submit_rate, got.cpu_ms_per_turn)
