"""An HTTP load client for the gateway benchmark: ``python -m bench._http_load SPEC_JSON``.

Runs in its own process (so its CPU is not the server's), sends ``count`` requests from
``concurrency`` connections, and prints one JSON line: rate, latency percentiles, statuses, and
(for submissions) the job ids the server answered with, so a later read phase can fetch them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from bench._common import percentile


def _turn(n: int) -> dict[str, Any]:
    # A small payload like an agent turn's reference to its conversation; the same for every system.
    return {"kind": "bench.noop", "payload": {"n": n, "conversation": f"c-{n % 97}", "text": "x" * 64}}


def _request(spec: dict[str, Any], n: int, run: str) -> tuple[str, str, bytes | None, dict[str, str]]:
    tokens, mode = spec["tokens"], spec["mode"]
    if mode == "status":
        # A tenant sees only its own jobs: each id is read with the token that submitted it.
        owner, job_id = spec["ids"][n % len(spec["ids"])]
        return "GET", f"/api/graph/jobs/{job_id}", None, {"Authorization": f"Bearer {tokens[owner]}"}
    headers = {"Authorization": f"Bearer {tokens[n % len(tokens)]}"}
    if mode == "single":
        headers["Idempotency-Key"] = f"{run}-{n}"
        headers["Content-Type"] = "application/json"
        return "POST", "/api/turns", json.dumps(_turn(n)).encode(), headers
    if mode == "batch":
        size = spec["batch"]
        turns = [_turn(n * size + i) | {"idempotency_key": f"{run}-{n}-{i}"} for i in range(size)]
        headers["Content-Type"] = "application/json"
        return "POST", "/api/turns:batch", json.dumps({"turns": turns}).encode(), headers
    raise ValueError(f"unknown mode {mode!r}")


async def _run(spec: dict[str, Any]) -> dict[str, Any]:
    count, concurrency = spec["count"], spec["concurrency"]
    run = uuid.uuid4().hex[:10]
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    ids: list[tuple[int, str]] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(spec["url"], connector=connector) as session:

        async def phase(first: int, last: int, record: bool) -> float:
            next_n = first

            async def client() -> None:
                nonlocal next_n
                while next_n < last:
                    n = next_n
                    next_n += 1
                    method, path, body, headers = _request(spec, n, run)
                    started = time.perf_counter()
                    async with session.request(method, path, data=body, headers=headers) as response:
                        answer = await response.read()
                    if not record:
                        continue
                    latencies.append(time.perf_counter() - started)
                    statuses[response.status] += 1
                    if spec.get("collect_ids") and response.status == 202:
                        ids.append((n % len(spec["tokens"]), json.loads(answer)["job_id"]))

            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            return time.perf_counter() - started

        # Open the connections and warm the server's first-request paths outside the timing.
        warm = 2 * concurrency
        await phase(count, count + warm, record=False)
        elapsed = await phase(0, count, record=True)
    per_request = spec["batch"] if spec["mode"] == "batch" else 1
    return {
        "requests": count,
        "seconds": elapsed,
        "rate": count * per_request / elapsed,
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "statuses": {str(k): v for k, v in statuses.items()},
        "ids": ids,
    }


def main() -> int:
    arg = sys.argv[1]
    spec = json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg)
    print(json.dumps(asyncio.run(_run(spec))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
