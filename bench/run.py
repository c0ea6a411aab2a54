"""Every benchmark of issue 9 in one run: ``python -m bench.run [--quick | --full]``.

Starts its own PostgreSQL and Kafka (testenv, loopback), installs the peers into the cache
(outside the repository), runs everything, and writes ``docs/benchmarks.md`` plus
``docs/benchmarks-throughput.png`` and ``docs/benchmarks-claim-latency.png``. Each figure is the
median of several runs; each comparison is a ratio of two figures measured in the same run, with
the systems interleaved within every round so a busy machine slows all of them alike.

The raw measurements are also saved as JSON under ``~/.cache/agent-dispatch/bench/``; ``--render
FILE`` rewrites the doc and charts from such a file without measuring again.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import _peers
from bench._common import (
    BATCH,
    CACHE,
    CONCURRENCY,
    OURS,
    RAW_KAFKA,
    RAW_KAFKA_STORE,
    RAW_PG,
    RAW_SQLITE,
    ROOT,
    loadavg,
    machine,
    python_cmd,
    say,
    tool_version,
)
from bench._render import scrub, write

MODES: dict[str, dict[str, Any]] = {
    # A check of the harness itself (minutes); its figures mean little.
    "smoke": {
        "rounds": 1,
        "turns": 300,
        "processes": [1, 2],
        "other_turns": 300,
        "claim_sizes": [1000, 5000],
        "claim_samples": 100,
        "fair_big": 2000,
        "fair_others": 8,
        "dispatch_samples": 10,
        "idle_s": 3,
    },
    "quick": {
        "rounds": 3,
        "turns": 2000,
        "processes": [1, 2, 4],
        "other_turns": 1000,
        "claim_sizes": [1000, 100_000],
        "claim_samples": 1000,
        "fair_big": 100_000,
        "fair_others": 98,
        "dispatch_samples": 50,
        "idle_s": 15,
    },
    "full": {
        "rounds": 3,
        "turns": 20_000,
        "processes": [1, 2, 4],
        "other_turns": 10_000,
        "claim_sizes": [1000, 100_000, 1_000_000],
        "claim_samples": 2000,
        "fair_big": 100_000,
        "fair_others": 998,
        "dispatch_samples": 200,
        "idle_s": 60,
    },
}


class Results:
    def __init__(self, mode: str, command: str) -> None:
        self.data: dict[str, Any] = {
            "mode": mode,
            "command": command,
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(),
            "load_before": loadavg(),
            "settings": {"concurrency": CONCURRENCY, "batch": BATCH, **MODES[mode]},
            "e2e": [],
            "errors": [],
        }

    def e2e(self, backend: str) -> Any:
        def record(
            system: str,
            processes: int,
            rate: float | None,
            error: str | None,
            submit: float | None = None,
            cpu_ms: float | None = None,
        ) -> None:
            self.data["e2e"].append(
                {
                    "backend": backend,
                    "system": system,
                    "processes": processes,
                    "rate": rate,
                    "error": error,
                    "submit_rate": submit,
                    "cpu_ms_per_turn": cpu_ms,
                }
            )

        return record

    def section(self, name: str, fn: Any) -> None:
        """Run one section; a failure is recorded and the run goes on."""
        try:
            self.data[name] = fn()
        except Exception as exc:
            say(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            self.data["errors"].append({"section": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            traceback.print_exc()


def measure(mode: str, command: str, only: set[str] | None) -> dict[str, Any]:
    from bench import _e2e, _idle, _queue
    from bench._e2e import CommandDriver, Databases, OursDriver, SqliteRawDriver
    from testenv.kafka import KafkaBroker
    from testenv.postgres import PostgresServer

    cfg = MODES[mode]
    results = Results(mode, command)
    log_dir = Path(tempfile.mkdtemp(prefix="agent-dispatch-bench-logs-"))
    say(f"logs in {log_dir}")

    def wanted(name: str) -> bool:
        return only is None or name in only

    with PostgresServer() as pg:
        dbs = Databases(pg)

        def fresh(name: str) -> str:
            return dbs.fresh(name)[1]

        results.data["versions"] = {
            "postgresql": pg.version,
            "node": tool_version(["node", "--version"]),
            "go": tool_version(["go", "version"]),
        }
        if wanted("postgres"):
            peers, missing = _peers.install()
            results.data["peers"] = [asdict(p) | {"prefix": None, "cwd": None} for p in peers]
            results.data["peers_missing"] = [asdict(m) for m in missing]
            from bench._raw_pg import REMAINING as RAW_REMAINING

            drivers: list[tuple[str, Any]] = [
                (OURS, lambda: OursDriver("postgres", dbs)),
                (
                    RAW_PG,
                    lambda: CommandDriver(
                        RAW_PG, tuple(python_cmd("-m", "bench._raw_pg")), ROOT, RAW_REMAINING, dbs
                    ),
                ),
            ]
            # Every peer at both settings (the fairness one and its documented throughput one),
            # in the same interleaved rounds.
            drivers += [
                (s.label, lambda p=p, s=s: CommandDriver.for_peer(p, s, dbs))
                for p in peers
                for s in p.settings
            ]
            _e2e.run_rounds(
                drivers,
                processes=cfg["processes"],
                count=cfg["turns"],
                rounds=cfg["rounds"],
                log_dir=log_dir,
                record=results.e2e("postgres"),
            )

        if wanted("sqlite"):
            _e2e.run_rounds(
                [(OURS, lambda: OursDriver("sqlite", None)), (RAW_SQLITE, SqliteRawDriver)],
                processes=[1],
                count=cfg["other_turns"],
                rounds=cfg["rounds"],
                log_dir=log_dir,
                record=results.e2e("sqlite"),
            )

        if wanted("kafka"):

            def kafka() -> dict[str, Any]:
                with KafkaBroker() as broker:
                    results.data["versions"]["kafka"] = broker.version
                    record = results.e2e("kafka")
                    for round_no in range(1, cfg["rounds"] + 1):
                        try:
                            # The bare loop needs more messages than we do to reach its rate
                            # (fixed start-up waits would dominate); a rate is a rate.
                            rate = _e2e.kafka_raw(broker.bootstrap, max(cfg["other_turns"], 20_000))
                            say(f"round {round_no}: {RAW_KAFKA:<28} {rate:8.1f} turns/s")
                            record(RAW_KAFKA, 1, rate, None)
                        except Exception as exc:
                            record(RAW_KAFKA, 1, None, f"{type(exc).__name__}: {exc}"[:200])
                        try:
                            rate = _e2e.kafka_raw_with_store(
                                broker.bootstrap, fresh("raw_kafka_store"), max(cfg["other_turns"], 20_000)
                            )
                            say(f"round {round_no}: {RAW_KAFKA_STORE:<28} {rate:8.1f} turns/s")
                            record(RAW_KAFKA_STORE, 1, rate, None)
                        except Exception as exc:
                            record(RAW_KAFKA_STORE, 1, None, f"{type(exc).__name__}: {exc}"[:200])
                        _e2e.run_rounds(
                            [(OURS, lambda: OursDriver("kafka", dbs, broker.bootstrap))],
                            processes=[1],
                            count=cfg["other_turns"],
                            rounds=1,
                            log_dir=log_dir,
                            record=record,
                        )
                return {}

            results.section("kafka_run", kafka)

        if wanted("claim"):
            results.section(
                "claim",
                lambda: {
                    str(k): v
                    for k, v in _queue.claim_latency(fresh, cfg["claim_sizes"], cfg["claim_samples"]).items()
                },
            )
        if wanted("fairness"):
            results.section(
                "fairness",
                lambda: [
                    _queue.fairness(fresh, cfg["fair_big"], 0),
                    _queue.fairness(fresh, cfg["fair_big"], cfg["fair_others"]),
                ],
            )
        if wanted("idle"):
            results.section(
                "idle",
                lambda: _idle.dispatch_and_idle(
                    pg, samples=cfg["dispatch_samples"], idle_s=cfg["idle_s"], log_dir=log_dir
                ),
            )
            results.section("gateway", lambda: _idle.gateway_rss(pg, log_dir))
        if wanted("gateway"):
            from bench import gateway_bench

            results.section("gateway_api", lambda: gateway_bench.measure(pg, mode=mode, log_dir=log_dir))
    if wanted("idle"):
        results.section("operator", lambda: _idle.operator_rss(log_dir))
    results.data["load_after"] = loadavg()
    return results.data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="a short pass (the default)")
    group.add_argument("--full", action="store_true", help="the issue's sizes: 20,000 turns, 1M queued")
    group.add_argument("--smoke", action="store_true", help="tiny sizes: checks the harness, not the system")
    group.add_argument("--render", metavar="JSON", help="rewrite the doc and charts from a saved run")
    parser.add_argument(
        "--only",
        help="comma-separated sections: postgres,sqlite,kafka,claim,fairness,idle,gateway"
        " (the results are saved; docs/benchmarks.md is left as it is)",
    )
    args = parser.parse_args(argv)
    if args.render:
        write(json.loads(Path(args.render).read_text()))
        return 0
    mode = "full" if args.full else "smoke" if args.smoke else "quick"
    command = "python -m bench.run " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    started = time.monotonic()
    data = measure(mode, command.strip(), set(args.only.split(",")) if args.only else None)
    data["elapsed_s"] = time.monotonic() - started
    CACHE.mkdir(parents=True, exist_ok=True)
    saved = CACHE / f"results-{mode}-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%S')}.json"
    saved.write_text(json.dumps(data, indent=1))
    say(f"results saved to {scrub(str(saved))}")
    if args.only:
        # The doc shows every section of one run; a partial run would drop the others from it.
        say("some sections only: docs/benchmarks.md left as it is (render a whole run with --render)")
        return 0
    write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
