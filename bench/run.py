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
    ROOT,
    loadavg,
    machine,
    median,
    python_cmd,
    say,
    tool_version,
)

DOC = ROOT / "docs" / "benchmarks.md"
FINDINGS = ROOT / "bench" / "findings.md"

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

RAW_PG = "raw psycopg loop"
RAW_SQLITE = "raw sqlite3 loop"
RAW_KAFKA = "raw confluent-kafka loop"
OURS = "agent-dispatch"


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
            system: str, processes: int, rate: float | None, error: str | None, submit: float | None = None
        ) -> None:
            self.data["e2e"].append(
                {
                    "backend": backend,
                    "system": system,
                    "processes": processes,
                    "rate": rate,
                    "error": error,
                    "submit_rate": submit,
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
            drivers += [(p.name, lambda p=p: CommandDriver.for_peer(p, dbs)) for p in peers]
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

        def fresh(name: str) -> str:
            return dbs.fresh(name)[1]

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
    if wanted("idle"):
        results.section("operator", lambda: _idle.operator_rss(log_dir))
    results.data["load_after"] = loadavg()
    return results.data


# --- rendering ------------------------------------------------------------------------------------


def _rates(data: dict[str, Any], backend: str, system: str, processes: int) -> list[float]:
    return [
        r["rate"]
        for r in data["e2e"]
        if r["backend"] == backend and r["system"] == system and r["processes"] == processes and r["rate"]
    ]


def _med(data: dict[str, Any], backend: str, system: str, processes: int) -> float | None:
    rates = _rates(data, backend, system, processes)
    return median(rates) if rates else None


def _fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def _systems(data: dict[str, Any], backend: str) -> list[str]:
    seen: list[str] = []
    for r in data["e2e"]:
        if r["backend"] == backend and r["system"] not in seen:
            seen.append(r["system"])
    return seen


def render(data: dict[str, Any]) -> str:
    m = data["machine"]
    cfg = data["settings"]
    procs = cfg["processes"]
    lines: list[str] = []
    w = lines.append
    w("# Benchmarks")
    w("")
    w("Generated by `bench/run.py`; do not edit by hand (notes come from `bench/findings.md`).")
    w("")
    w(
        f"- Command: `{data['command']}` ({data['mode']} mode: {cfg['turns']:,} turns per PostgreSQL run, "
        f"{cfg['other_turns']:,} per Kafka/SQLite run, median of {cfg['rounds']} runs)"
    )
    w(f"- Date: {data['date']}")
    w(
        f"- Machine: {m['cores']} cores, {m['memory_gib']} GiB memory, {m['cpu_model']}, "
        f"{m['os']} {m['kernel']}, Python {m['python']}"
    )
    if data.get("elapsed_s"):
        w(f"- Duration of this run: {data['elapsed_s'] / 60:.0f} minutes")
    lb, la = data["load_before"], data.get("load_after", data["load_before"])
    w(
        f"- Load average (1/5/15 min): {lb[0]:.2f} / {lb[1]:.2f} / {lb[2]:.2f} at the start, "
        f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f} at the end. Other work shared the machine, "
        "so absolute figures are noisy; the ratios (same run, interleaved) are what to read."
    )
    versions = data.get("versions", {})
    if versions:
        names = {"postgresql": "PostgreSQL", "node": "Node", "go": "Go", "kafka": "Apache Kafka"}
        shown = [
            f"{names.get(k, k)} {str(v).removeprefix('go version ').removeprefix(names.get(k, k) + ' ')}"
            for k, v in versions.items()
        ]
        w("- Services and tools: " + ", ".join(shown))
    w(
        f"- Every system runs {CONCURRENCY} workers per process (River: 100, its quick start's setting) and "
        f"submits in batches of {cfg['batch']} with its own batch-insert API, from a separate process; "
        "PostgreSQL is testenv's loopback server (fsync off, the same for all). The raw Kafka loop "
        "(bench/kafka_bench.py) runs at least 20,000 messages so its start-up waits do not hide its rate."
    )
    w("")

    # --- goals -------------------------------------------------------------------------------------
    w("## Goals")
    w("")
    w("| goal | measured | status |")
    w("| --- | --- | --- |")
    peers_run = [s for s in _systems(data, "postgres") if s not in (OURS, RAW_PG)]
    for k in procs:
        ours = _med(data, "postgres", OURS, k)
        for peer in peers_run:
            theirs = _med(data, "postgres", peer, k)
            ratio = ours / theirs if ours and theirs else None
            w(
                f"| PostgreSQL end to end >= 1.0x {peer} ({k} proc) | {_fmt(ratio, 2)}x | "
                f"{_verdict(None if ratio is None else ratio >= 1.0)} |"
            )
        raw = _med(data, "postgres", RAW_PG, k)
        ratio = ours / raw if ours and raw else None
        w(
            f"| PostgreSQL end to end >= 0.5x raw ceiling ({k} proc) | {_fmt(ratio, 3)}x | "
            f"{_verdict(None if ratio is None else ratio >= 0.5)} |"
        )
    claim = data.get("claim") or {}
    if claim:
        sizes = sorted(int(s) for s in claim)
        small, large = str(sizes[0]), str(sizes[-1])
        for q in ("p50_ms", "p99_ms"):
            ratio = claim[large][q] / claim[small][q]
            w(
                f"| claim latency {q[:3]} at {int(large):,} within 1.5x of {int(small):,} | {ratio:.2f}x | "
                f"{_verdict(ratio <= 1.5)} |"
            )
    for fair in data.get("fairness") or []:
        w(
            f"| small tenant waits <= 2 x {fair['tenants_with_work']} claims ({fair['big_queued']:,} queued by a "
            f"big tenant) | first after {fair['claims_before_first']}, largest gap {fair['max_gap']} | "
            f"{_verdict(max(fair['claims_before_first'], fair['max_gap']) <= fair['goal'])} |"
        )
    idle = data.get("idle") or {}
    if idle:
        w(
            f"| dispatch latency p50 < 20 ms (idle workers) | {idle['dispatch_p50_ms']:.1f} ms | "
            f"{_verdict(idle['dispatch_p50_ms'] < 20)} |"
        )
        w(
            f"| idle worker CPU < 1% of a core | {idle['idle_cpu_pct']:.2f}% | {_verdict(idle['idle_cpu_pct'] < 1)} |"
        )
    for backend, raw_name in (("kafka", RAW_KAFKA), ("sqlite", RAW_SQLITE)):
        ours = _med(data, backend, OURS, 1)
        raw = _med(data, backend, raw_name, 1)
        ratio = ours / raw if ours and raw else None
        w(
            f"| {backend} end to end >= 0.5x raw ceiling | {_fmt(ratio, 3)}x | "
            f"{_verdict(None if ratio is None else ratio >= 0.5)} |"
        )
    w("")

    # --- throughput ----------------------------------------------------------------------------------
    w("## End-to-end throughput (turns/s)")
    w("")
    w(
        "Submit, claim, lease, no-op execute, commit, acknowledge: the time from the first submit until the "
        "last turn is finished, with the workers already running and idle. Medians; every run in brackets."
    )
    w("")
    w("![throughput](benchmarks-throughput.png)")
    w("")
    w("### PostgreSQL")
    w("")
    w("| system | " + " | ".join(f"{k} process{'es' if k > 1 else ''}" for k in procs) + " |")
    w("| --- |" + " --- |" * len(procs))
    for system in _systems(data, "postgres"):
        cells = []
        for k in procs:
            rates = _rates(data, "postgres", system, k)
            cells.append(
                f"{_fmt(median(rates)) if rates else 'failed'} ({', '.join(f'{r:,.0f}' for r in rates)})"
            )
        w(f"| {system} | " + " | ".join(cells) + " |")
    w("")
    w("| ratio (ours / other) | " + " | ".join(f"{k} proc" for k in procs) + " |")
    w("| --- |" + " --- |" * len(procs))
    for system in _systems(data, "postgres"):
        if system == OURS:
            continue
        cells = []
        for k in procs:
            ours, other = _med(data, "postgres", OURS, k), _med(data, "postgres", system, k)
            cells.append(f"{ours / other:.2f}x" if ours and other else "n/a")
        w(f"| {system} | " + " | ".join(cells) + " |")
    w("")
    if any(r.get("submit_rate") for r in data["e2e"]):
        w(
            "Submission alone, in the same runs (turns/s from the inserter's first submit until it exited, "
            "while the workers ran): an end-to-end figure cannot pass it."
        )
        w("")
        w("| system | " + " | ".join(f"{k} proc" for k in procs) + " |")
        w("| --- |" + " --- |" * len(procs))
        for system in _systems(data, "postgres"):
            cells = []
            for k in procs:
                sub = [
                    r["submit_rate"]
                    for r in data["e2e"]
                    if r["backend"] == "postgres"
                    and r["system"] == system
                    and r["processes"] == k
                    and r.get("submit_rate")
                ]
                cells.append(_fmt(median(sub)) if sub else "n/a")
            w(f"| {system} | " + " | ".join(cells) + " |")
        w("")
    w("### Kafka and SQLite (1 worker process)")
    w("")
    w("| backend | agent-dispatch | raw ceiling | ratio |")
    w("| --- | --- | --- | --- |")
    for backend, raw_name in (("kafka", RAW_KAFKA), ("sqlite", RAW_SQLITE)):
        ours, raw = _med(data, backend, OURS, 1), _med(data, backend, raw_name, 1)
        w(
            f"| {backend} | {_fmt(ours)} | {_fmt(raw)} ({raw_name}) | "
            f"{f'{ours / raw:.3f}x' if ours and raw else 'n/a'} |"
        )
    w("")
    failed = [r for r in data["e2e"] if r["error"]]
    if failed:
        w("Failed runs (left out of the medians):")
        w("")
        for r in failed:
            w(f"- {r['backend']} / {r['system']} / {r['processes']} proc: {r['error']}")
        w("")

    # --- peers ---------------------------------------------------------------------------------------
    w("### Peers")
    w("")
    for p in data.get("peers", []):
        notes = _peers.NOTES.get(p["name"], p["notes"])
        w(f"- **{p['name']}** {p['version']}: {notes}. Harness: `bench/peers/` (our code, their public API).")
    if data.get("peers") is not None and not data.get("peers_missing"):
        w("")
        w("Every peer installed from its own registry and ran; none had to be left out.")
    for p in data.get("peers_missing", []):
        w(f"- **{p['name']}** could not be installed: `{_scrub(p['command'])}` failed with:")
        w("")
        w("  ```")
        for line in _scrub(p["error"]).splitlines()[-8:]:
            w(f"  {line}")
        w("  ```")
    w("")

    # --- claim latency -------------------------------------------------------------------------------
    if claim:
        w("## Claim latency against queue depth (PostgreSQL, 1,000 tenants)")
        w("")
        w(
            "One fair claim (`PostgresTransport.claim`), timed in interleaved blocks across the sizes; each "
            "claimed turn is acknowledged and replaced outside the timing (bench/pg_queue_bench.py)."
        )
        w("")
        w("![claim latency](benchmarks-claim-latency.png)")
        w("")
        w("| queued turns | p50 (ms) | p99 (ms) | samples |")
        w("| --- | --- | --- | --- |")
        for size in sorted(claim, key=int):
            c = claim[size]
            w(f"| {int(size):,} | {c['p50_ms']:.2f} | {c['p99_ms']:.2f} | {c['samples']} |")
        w("")
    if data.get("fairness"):
        w("## Fairness")
        w("")
        w(
            "A big tenant's backlog is admitted first, then (second row) other tenants with 10 turns each, then "
            "a small tenant's 10 turns; claims are taken one at a time until the small tenant is served."
        )
        w("")
        w(
            "| big tenant queued | tenants with work | claims before the small tenant's first | largest gap "
            "between its claims | claims until its 10 are done | goal (<=) |"
        )
        w("| --- | --- | --- | --- | --- | --- |")
        for f in data["fairness"]:
            w(
                f"| {f['big_queued']:,} | {f['tenants_with_work']} | {f['claims_before_first']} | {f['max_gap']} | "
                f"{f['claims_until_small_done']} | {f['goal']} |"
            )
        w("")
    if idle or data.get("gateway") or data.get("operator"):
        w("## Idle behaviour and memory")
        w("")
        w("| measure | value |")
        w("| --- | --- |")
        if idle:
            w(
                f"| dispatch latency, submit to executor start, p50 / p99 ({idle['dispatch_samples']} turns, "
                f"1 idle worker process, LISTEN/NOTIFY) | {idle['dispatch_p50_ms']:.1f} / "
                f"{idle['dispatch_p99_ms']:.1f} ms |"
            )
            w(
                f"| idle worker CPU over {idle['idle_window_s']:.0f} s ({CONCURRENCY} claim loops) | "
                f"{idle['idle_cpu_pct']:.2f}% of a core |"
            )
            w(
                f"| PostgreSQL server CPU over the same window (all sessions) | {idle['idle_server_cpu_pct']:.2f}% |"
            )
            w(f"| idle worker resident memory | {idle['worker_rss_mib']:.0f} MiB |")
        if data.get("gateway"):
            w(f"| idle gateway resident memory | {data['gateway']['gateway_rss_mib']:.0f} MiB |")
        if data.get("operator"):
            o = data["operator"]
            w(
                f"| idle operator resident memory (one watched namespace, kube-apiserver {o['kube_version']}) | "
                f"{o['operator_rss_mib']:.0f} MiB (CPU {o['operator_idle_cpu_pct']:.2f}%) |"
            )
        w("")
    if data["errors"]:
        w("## Sections that failed")
        w("")
        for e in data["errors"]:
            w(f"- {e['section']}: {_scrub(e['error']).splitlines()[0]}")
        w("")
    if FINDINGS.exists():
        w(FINDINGS.read_text().rstrip())
        w("")
    w("## Reproduce")
    w("")
    w("```")
    w("pip install -e '.[bench]'")
    w("python -m bench.run --quick   # about 10 minutes on 2 cores, once the peers are installed")
    w("python -m bench.run --full    # the issue's sizes (20,000 turns, 1M queued): about 35 minutes")
    w("```")
    return "\n".join(lines) + "\n"


def _scrub(text: str) -> str:
    """No home directories or temporary paths in the doc."""
    import re

    text = text.replace(str(Path.home()), "~")
    return re.sub(r"/tmp/[\w.\-/]+", "<tmp>", text)


def charts(data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = data["settings"]["processes"]
    systems = _systems(data, "postgres")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        values = [_med(data, "postgres", system, k) or 0 for k in procs]
        bars = ax.bar([x + i * width for x in range(len(procs))], values, width, label=system)
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=7, rotation=90, padding=2)
    ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(procs))])
    ax.set_xticklabels([f"{k} worker process{'es' if k > 1 else ''}" for k in procs])
    ax.set_ylabel("turns / s (median)")
    ax.set_yscale("log")
    top = max((_med(data, "postgres", sys_, k) or 1) for sys_ in systems for k in procs) if systems else 1
    ax.set_ylim(top=top * 4)  # room for the bar labels
    ax.set_title("PostgreSQL end to end")
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    labels, ours, raws = [], [], []
    for backend, raw_name in (("kafka", RAW_KAFKA), ("sqlite", RAW_SQLITE)):
        labels.append(backend)
        ours.append(_med(data, backend, OURS, 1) or 0)
        raws.append(_med(data, backend, raw_name, 1) or 0)
    ax2.bar([x - 0.2 for x in range(2)], ours, 0.4, label=OURS)
    ax2.bar([x + 0.2 for x in range(2)], raws, 0.4, label="raw ceiling")
    ax2.set_xticks(range(2))
    ax2.set_xticklabels(labels)
    ax2.set_yscale("log")
    ax2.set_ylim(top=max([*ours, *raws, 1]) * 4)
    ax2.set_title("Kafka / SQLite (1 process)")
    ax2.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{data['mode']} run, {data['date']}")
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "benchmarks-throughput.png", dpi=110)
    plt.close(fig)

    claim = data.get("claim") or {}
    if claim:
        sizes = sorted(int(s) for s in claim)
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for q, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
            ax.plot(sizes, [claim[str(s)][q] for s in sizes], style, label=q[:3])
        ax.set_xscale("log")
        ax.set_xlabel("queued turns (1,000 tenants)")
        ax.set_ylabel("claim latency (ms)")
        ax.set_ylim(bottom=0)
        ax.set_title("PostgreSQL fair claim latency against queue depth")
        ax.legend()
        fig.tight_layout()
        fig.savefig(ROOT / "docs" / "benchmarks-claim-latency.png", dpi=110)
        plt.close(fig)


def write(data: dict[str, Any]) -> None:
    DOC.write_text(render(data))
    charts(data)
    say(f"wrote {DOC.relative_to(ROOT)} and its charts")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="a short pass (the default)")
    group.add_argument("--full", action="store_true", help="the issue's sizes: 20,000 turns, 1M queued")
    group.add_argument("--smoke", action="store_true", help="tiny sizes: checks the harness, not the system")
    group.add_argument("--render", metavar="JSON", help="rewrite the doc and charts from a saved run")
    parser.add_argument("--only", help="comma-separated sections: postgres,sqlite,kafka,claim,fairness,idle")
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
    say(f"results saved to {_scrub(str(saved))}")
    write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
