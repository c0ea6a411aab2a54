"""Benchmark harness for procrastinate (our code, calling its public API only).

Run with the interpreter of procrastinate's own virtual environment (``bench._peers`` makes it):

    procrastinate_bench.py setup  DSN                    apply its schema (schema_manager.apply_schema)
    procrastinate_bench.py work   DSN WORKERS [SETTING]  run_worker_async with a no-op task until SIGTERM
    procrastinate_bench.py insert DSN COUNT BATCH        batch_defer COUNT no-op jobs, BATCH per call

SETTING ``fair`` (the default): concurrency WORKERS, everything else its defaults. SETTING
``throughput``: concurrency WORKERS (30 in docs/howto/production/concurrency.md) with a connection
pool of WORKERS + 1, as docs/discussions.md advises for short jobs ("Mind the size of your
PostgreSQL pool"); LISTEN/NOTIFY and the polling interval stay at their defaults.
"""

from __future__ import annotations

import asyncio
import sys
import time

import procrastinate

SETTINGS = ("fair", "throughput")


def make_app(dsn: str, pool_size: int | None = None) -> procrastinate.App:
    pool = {} if pool_size is None else {"max_size": pool_size}
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn, **pool))

    @app.task(name="noop")
    async def noop() -> None:
        return None

    return app


async def work(app: procrastinate.App, concurrency: int) -> None:
    async with app.open_async():
        print("ready", flush=True)
        await app.run_worker_async(concurrency=concurrency, install_signal_handlers=True)


def main(argv: list[str]) -> None:
    command, dsn, *rest = argv
    if command == "work":
        workers, setting = int(rest[0]), rest[1] if len(rest) > 1 else "fair"
        if setting not in SETTINGS:
            raise SystemExit(f"unknown setting {setting}")
        app = make_app(dsn, workers + 1 if setting == "throughput" else None)
        asyncio.run(work(app, workers))
        return
    app = make_app(dsn)
    if command == "setup":
        with app.open():
            app.schema_manager.apply_schema()
    elif command == "insert":
        count, batch = int(rest[0]), int(rest[1])
        task = app.tasks["noop"]
        with app.open():
            print(f"start {time.time():.6f}", flush=True)
            for done in range(0, count, batch):
                task.batch_defer(*[{} for _ in range(min(batch, count - done))])
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv[1:])
