"""The gateway's own throughput: ``python -m bench.gateway_bench [--quick | --full]``.

Turns/s and latency through ``POST /api/turns`` (many concurrent clients, one turn per request,
each with an Idempotency-Key), ``POST /api/turns:batch`` (100 turns per request) and
``GET /api/graph/jobs/{id}``, on PostgreSQL, each beside:

- its ceiling: the same requests against a bare aiohttp server that only validates the bodies with
  the gateway's own models (``bench/_bare_gateway.py``), so HTTP and parsing are priced alike;
- for the batch endpoint, direct ``enqueue_many`` of the same turns (``bench/_ours.py insert``), so
  what HTTP adds to a batch is visible.

The load comes from a separate process (``bench/_http_load.py``); the systems alternate within
every round so a busy machine slows them alike. ``bench.run`` runs this as its ``gateway`` section.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._common import BATCH, median, python_cmd, say, spawn
from bench._e2e import Databases, OursDriver

#: Concurrent HTTP connections for the one-turn endpoints (a busy gateway's many clients).
CLIENTS = 32
#: Concurrent connections posting batches.
BATCH_CLIENTS = 4
#: Tenants the load is spread over (one token each), like the direct submitter's 100.
TENANTS = 100

SIZES = {
    "smoke": {"rounds": 1, "requests": 300, "batches": 5},
    "quick": {"rounds": 3, "requests": 3000, "batches": 30},
    "full": {"rounds": 3, "requests": 10_000, "batches": 100},
}


def _load(spec: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    # In a file, not in argv: the status mode's 10,000 job ids pass the kernel's 128 KiB limit on
    # one argument (E2BIG).
    spec_file = log_dir / f"http-load-{spec['mode']}.json"
    spec_file.write_text(json.dumps(spec))
    proc = spawn(
        "http-load", python_cmd("-m", "bench._http_load", f"@{spec_file}"), env=_env(), log_dir=log_dir
    )
    if proc.popen.wait(600) != 0:
        raise RuntimeError(f"load client failed:\n{proc.tail()}")
    proc.stop()
    return dict(json.loads(proc.lines[-1]))


def _env() -> dict[str, str]:
    from bench._common import BASE_ENV, ROOT

    return {**BASE_ENV, "PYTHONPATH": str(ROOT)}


def _direct(driver: OursDriver, count: int, log_dir: Path) -> float:
    """``enqueue_many`` in batches of :data:`BATCH`, from the first submit to the last (turns/s)."""
    proc = spawn(
        "direct",
        python_cmd("-m", "bench._ours", "insert", str(count), str(BATCH)),
        env=driver.env,
        log_dir=log_dir,
    )
    started = float(proc.wait_line("start ", 120).split()[1])
    ended = float(proc.wait_line("end ", 600).split()[1])
    if proc.popen.wait(60) != 0:
        raise RuntimeError(f"direct submitter failed:\n{proc.tail()}")
    return count / (ended - started)


def measure(pg: Any, *, mode: str, log_dir: Path) -> dict[str, Any]:
    """Every figure, medians over the rounds; raw samples kept under ``runs``."""
    from agent_dispatch.gateway import hash_token, new_token, write_tokens_file

    size = SIZES[mode]
    driver = OursDriver("postgres", Databases(pg))
    driver.prepare()
    tokens = [new_token() for _ in range(TENANTS)]
    tokens_file = Path(tempfile.mkdtemp(prefix="agent-dispatch-bench-")) / "tokens.yaml"
    write_tokens_file(tokens_file, {f"tenant-{i}": [hash_token(t)] for i, t in enumerate(tokens)})
    gateway = spawn(
        "gateway",
        python_cmd("-m", "agent_dispatch.cli", "gateway", "--port", "0"),
        env={
            **driver.env,
            "AGENT_DISPATCH_TOKENS_FILE": str(tokens_file),
            "AGENT_DISPATCH_METRICS_PORT": "0",
        },
        log_dir=log_dir,
    )
    bare = spawn("bare-gateway", python_cmd("-m", "bench._bare_gateway"), env=_env(), log_dir=log_dir)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        urls = {
            "gateway": gateway.wait_line("agent-dispatch gateway: serving on", 120).rsplit(" ", 1)[1],
            "ceiling": bare.wait_line("bare gateway: serving on", 60).rsplit(" ", 1)[1],
        }
        ids: list[list[Any]] = []
        for round_no in range(1, size["rounds"] + 1):
            for system, url in urls.items():
                base = {"url": url, "tokens": tokens}
                single = _load(
                    base
                    | {
                        "mode": "single",
                        "count": size["requests"],
                        "concurrency": CLIENTS,
                        "collect_ids": True,
                    },
                    log_dir,
                )
                batch = _load(
                    base
                    | {
                        "mode": "batch",
                        "count": size["batches"],
                        "batch": BATCH,
                        "concurrency": BATCH_CLIENTS,
                    },
                    log_dir,
                )
                if system == "gateway":
                    ids = single.pop("ids") or ids
                status = _load(
                    base
                    | {
                        "mode": "status",
                        "count": size["requests"],
                        "concurrency": CLIENTS,
                        "ids": ids or ["x"],
                    },
                    log_dir,
                )
                for name, result in (("single", single), ("batch", batch), ("status", status)):
                    result.pop("ids", None)
                    runs.setdefault(f"{system}/{name}", []).append(result)
                    say(
                        f"round {round_no}: {system:<8} {name:<7} {result['rate']:9,.0f} turns/s "
                        f"p50 {result['p50_ms']:6.1f} ms p99 {result['p99_ms']:6.1f} ms {result['statuses']}"
                    )
            direct = _direct(driver, size["batches"] * BATCH, log_dir)
            runs.setdefault("direct/batch", []).append({"rate": direct})
            say(f"round {round_no}: enqueue_many direct   {direct:9,.0f} turns/s")
    finally:
        gateway.stop()
        bare.stop()
        driver.cleanup()
    summary = {
        key: {
            field: median([r[field] for r in samples])
            for field in ("rate", "p50_ms", "p99_ms")
            if all(field in r for r in samples)
        }
        for key, samples in runs.items()
    }
    bad = {
        key: [r["statuses"] for r in samples]
        for key, samples in runs.items()
        if any(set(r.get("statuses", {"202": 0})) - {"200", "202"} for r in samples)
    }
    return {
        "clients": CLIENTS,
        "batch_clients": BATCH_CLIENTS,
        "tenants": TENANTS,
        **size,
        "summary": summary,
        "runs": runs,
        "unexpected_statuses": bad,
    }


def main(argv: list[str] | None = None) -> int:
    from testenv.postgres import PostgresServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(SIZES), default="quick")
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="agent-dispatch-bench-logs-"))
    with PostgresServer() as pg:
        result = measure(pg, mode=args.mode, log_dir=log_dir)
    print(json.dumps(result["summary"], indent=1))
    if result["unexpected_statuses"]:
        print(f"unexpected statuses: {result['unexpected_statuses']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
