"""Batched PostgreSQL claims under concurrency: many claimers taking up to 16 turns each while turns arrive."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest

from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.postgres import PostgresTransport
from tests.postgres.test_pg_history import assert_consistent

pytestmark = pytest.mark.postgres


@pytest.fixture
def queue(postgres_dsn: str) -> Iterator[PostgresTransport]:
    q = PostgresTransport(postgres_dsn, max_depth=1_000_000, visibility_timeout_s=300, pool_max_size=12)
    q.ensure_ready()
    yield q
    q.close()


def turns(start: int, count: int) -> list[OutboundTurn]:
    out = []
    for n in range(start, start + count):
        work_item_id = f"wi-{n}-{uuid.uuid4().hex[:8]}"
        out.append(
            OutboundTurn(
                work_item_id,
                f"s-{n}",
                f"tenant-{n % 37}",
                work_item_id.encode(),
                priority=n % 2,
                fairness_group=f"g{n % 3}",
            )
        )
    return out


def test_concurrent_batch_claims_deliver_each_turn_once(queue: PostgresTransport, postgres_dsn: str) -> None:
    total = 3000
    queue.admit(turns(0, 1000))
    delivered: list[str] = []
    lock = threading.Lock()
    admitting = threading.Event()
    errors: list[BaseException] = []

    def admitter() -> None:
        try:
            for start in range(1000, total, 100):
                queue.admit(turns(start, 100))
                time.sleep(0.005)
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            admitting.set()

    def worker(i: int) -> None:
        try:
            idle_since: float | None = None
            while True:
                got = queue.claim(f"w{i}", max_items=16)
                if got:
                    idle_since = None
                    assert not queue.ack_many([d.receipt for d in got])
                    with lock:
                        delivered.extend(d.work_item_id for d in got)
                elif admitting.is_set():
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > 0.5:
                        return
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=admitter)] + [
        threading.Thread(target=worker, args=(i,)) for i in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    counts = Counter(delivered)
    assert len(counts) == total and max(counts.values()) == 1
    assert queue.depth() == 0
    assert_consistent(postgres_dsn)
