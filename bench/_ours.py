"""Our side of the end-to-end runs: the submitter, and the probe executor for dispatch latency.

    python -m bench._ours insert COUNT BATCH   (settings from the environment, like the gateway;
                                                prints "start <unix time>" before the first submit,
                                                "end <unix time>" after the last)

``probe`` is an executor plugin (``AGENT_DISPATCH_EXECUTOR=bench._ours:probe``): it sends the
job id and the time it started to ``AGENT_DISPATCH_BENCH_PROBE`` (a loopback UDP port).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from typing import Any

_PROBE = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def probe(envelope: Any, payload: bytes, guard: Any, logger: Any) -> None:
    started = time.time()
    port = int(os.environ["AGENT_DISPATCH_BENCH_PROBE"])
    _PROBE.sendto(f"{envelope.job_id} {started:.6f}".encode(), ("127.0.0.1", port))


def insert(count: int, batch: int) -> None:
    from agent_dispatch import dispatch, keys
    from agent_dispatch.errors import DispatchError
    from agent_dispatch.models import SubmitRequest
    from agent_dispatch.settings import load_or_exit
    from agent_dispatch.stores import open_store
    from agent_dispatch.transports import open_transport

    settings = load_or_exit("bench submit")
    key = keys.signing_key(settings)
    store = open_store(settings)
    transport = open_transport(settings)
    admission = dispatch.choose_admission(store, transport, signing_key=key, settings=settings)
    run = uuid.uuid4().hex[:8]
    store.now()  # connections up before the clock starts
    print(f"start {time.time():.6f}", flush=True)
    failed = 0
    for done in range(0, count, batch):
        requests = [
            SubmitRequest(
                tenant=f"tenant-{i % 100}", kind="noop", payload=b"{}", idempotency_key=f"{run}-{i}"
            )
            for i in range(done, min(done + batch, count))
        ]
        results = admission.enqueue_many(requests)
        failed += sum(isinstance(r, DispatchError) for r in results)
    print(f"end {time.time():.6f}", flush=True)
    transport.close()
    store.close()
    if failed:
        raise SystemExit(f"{failed} submissions refused")


def main(argv: list[str]) -> None:
    command, *rest = argv
    if command == "insert":
        insert(int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv[1:])
