"""Dependency-chain latency: how long a turn waits after the commit of the turn it depends on.

A chain of ``--links`` turns, each depending on the one before, is submitted through the real
admission path and run by one in-process worker (no-op executor, 2 claim loops) on each backend:
SQLite (queue in the store's file), PostgreSQL (queue in the store's database) and Kafka
(WorkItems in PostgreSQL). Per link: the dependent's ``claim`` record minus its dependency's
``commit`` record, both stamped by the store's clock (the database's), so no client clock is
involved. Printed: p50, p99 and max per backend, and the whole chain's time per link.

``--mode commit`` (today): the commit that releases a dependent dispatches it (in the commit's
transaction on SQLite and PostgreSQL, right after it on Kafka). ``--mode sweep`` (before issue 22):
the worker only commits, and released dependents wait for the recovery sweep, every
``--sweep-interval`` seconds (the default setting is 15).

Usage: ``python bench/chain_bench.py [--links 50] [--mode commit|sweep] [--sweep-interval 15]
[--backends sqlite,postgres,kafka]``. It starts throwaway PostgreSQL and Kafka servers with
testenv (loopback) and stops them at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent_dispatch.models import CommitResult, Lease, Outcome, SubmitRequest, WorkItem, WorkState
from agent_dispatch.runtime import Runtime, open_runtime
from agent_dispatch.settings import load
from agent_dispatch.worker import Worker
from agent_dispatch.worker._executors import noop
from agent_dispatch.worker._release import Committer

KEY = "bench-signing-key-" + "k" * 32


class CommitOnly(Committer):
    """The worker's commit before issue 22: released dependents are left to the recovery sweep."""

    def commit(self, lease: Lease, outcome: Outcome, *, error: str | None = None) -> CommitResult:
        return self.store.commit(lease, outcome, error=error)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def services(backends: list[str]) -> Iterator[dict[str, Any]]:
    """Throwaway servers for the backends that need them: ``{"dsn": fresh(), "bootstrap": ...}``."""
    with contextlib.ExitStack() as stack:
        found: dict[str, Any] = {}
        if {"postgres", "kafka"} & set(backends):
            from testenv.postgres import PostgresServer

            pg = stack.enter_context(PostgresServer())
            found["dsn"] = lambda: pg.create_database(f"chain_{uuid.uuid4().hex[:10]}")
        if "kafka" in backends:
            from testenv.kafka import KafkaBroker

            broker = KafkaBroker().start()
            stack.callback(broker.close)
            found["bootstrap"] = broker.bootstrap
        yield found


def open_backend(name: str, found: dict[str, Any], data_dir: Path, sweep_interval_s: float) -> Runtime:
    env: dict[str, Any] = {
        "AGENT_DISPATCH_SIGNING_KEY": KEY,
        "AGENT_DISPATCH_DATA_DIR": str(data_dir),
        "AGENT_DISPATCH_SWEEP_INTERVAL_S": sweep_interval_s,
        "AGENT_DISPATCH_LOG_LEVEL": "WARNING",
        "TASK_QUEUE_BACKEND": name,
    }
    if name in {"postgres", "kafka"}:
        env["STATE_DB_URI"] = found["dsn"]()
    if name == "kafka":
        env["KAFKA_BOOTSTRAP_SERVERS"] = found["bootstrap"]
        env["AGENT_DISPATCH_KAFKA_TOPIC"] = f"chain.{uuid.uuid4().hex[:8]}"
        env["AGENT_DISPATCH_KAFKA_GROUP"] = f"chain-{uuid.uuid4().hex[:8]}"
        env["AGENT_TURNS_PARTITIONS"] = "2"
    return open_runtime(load(**env), migrate=True)


def wait_succeeded(runtime: Runtime, item: WorkItem, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while runtime.store.get(item.id).state is not WorkState.SUCCEEDED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{item.id} did not succeed within {timeout_s:g}s")
        time.sleep(0.005)


def event_at(runtime: Runtime, item_id: str, event: str) -> float:
    return next(r.at.timestamp() for r in runtime.store.outcomes(item_id) if r.event == event)


def run_chain(runtime: Runtime, links: int, mode: str, counter: Iterator[int]) -> tuple[list[float], float]:
    """Per-link latencies (s) and the whole chain's seconds per link."""
    worker = Worker(
        runtime.settings,
        runtime.store,
        runtime.transport,
        noop,
        signing_key=runtime.signing_key,
        concurrency=2,
        redrive=lambda: redrive(runtime),
    )
    if mode == "sweep":
        worker.committer = CommitOnly(runtime.store, runtime.transport, signing_key=runtime.signing_key)
    admission = runtime.admission
    worker.start()
    try:
        # A warm-up turn: connections open, the Kafka consumers joined their group.
        warm = admission.enqueue(SubmitRequest(tenant="bench", kind="turn", payload=b"{}"))
        wait_succeeded(runtime, warm.item, 120)
        chain: list[WorkItem] = []
        started = time.monotonic()
        for _ in range(links):
            after = (chain[-1].id,) if chain else ()
            key = f"chain-{next(counter)}"
            request = SubmitRequest(
                tenant="bench", kind="turn", payload=b"{}", depends_on=after, idempotency_key=key
            )
            chain.append(admission.enqueue(request).item)
        wait_succeeded(runtime, chain[-1], links * (3 * runtime.settings.sweep_interval_s + 5))
        elapsed = time.monotonic() - started
    finally:
        worker.stop(grace_s=1)
        time.sleep(1.5)  # a claim loop may still be inside its 1 s claim wait: let it end before the close
    gaps = [
        event_at(runtime, child.id, "claim") - event_at(runtime, parent.id, "commit")
        for parent, child in itertools.pairwise(chain)
    ]
    return gaps, elapsed / links


def redrive(runtime: Runtime) -> int:
    from agent_dispatch import dispatch

    return dispatch.redrive(
        runtime.store, runtime.transport, settings=runtime.settings, signing_key=runtime.signing_key
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", type=int, default=50)
    parser.add_argument("--mode", choices=("commit", "sweep"), default="commit")
    parser.add_argument("--sweep-interval", type=float, default=15.0)
    parser.add_argument("--backends", default="sqlite,postgres,kafka")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    counter = itertools.count()
    print(f"mode {args.mode}, {args.links} links, sweep every {args.sweep_interval:g} s")
    print("| backend | links | p50 ms | p99 ms | max ms | chain s per link |")
    print("| --- | --- | --- | --- | --- | --- |")
    with services(backends) as found, tempfile.TemporaryDirectory(prefix="chain-bench-") as tmp:
        for name in backends:
            runtime = open_backend(name, found, Path(tmp) / name, args.sweep_interval)
            try:
                gaps, per_link = run_chain(runtime, args.links, args.mode, counter)
            finally:
                runtime.close()
            ms = [g * 1000 for g in gaps]
            print(
                f"| {name} | {len(ms)} | {percentile(ms, 0.5):.1f} | {percentile(ms, 0.99):.1f} "
                f"| {max(ms):.1f} | {per_link:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
