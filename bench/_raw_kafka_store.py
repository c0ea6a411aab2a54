"""Kafka's fair ceiling: the bare confluent-kafka loop plus the store writes the design requires.

On Kafka the WorkItem authority stays in PostgreSQL, so every turn also costs an insert (the
submit), a fenced lease (claim) and a fenced commit; the bare Kafka loop alone
(``bench/kafka_bench.py``) leaves those out. Here one producer thread inserts each batch of items
(one multi-row statement) and then produces them; one consumer takes up to 500 messages, leases
their items (one UPDATE), runs the no-op turn, commits them fenced (one UPDATE) and commits the
offsets asynchronously. The same SQL shapes as the PostgreSQL raw loop (``bench/_raw_pg.py``),
batched as the worker batches its store calls.
"""

from __future__ import annotations

import threading
import time

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition

from bench._raw_pg import SCHEMA

INSERT_MANY = """
INSERT INTO raw_item (tenant, state, payload)
SELECT t, 'ready', p FROM unnest(%s::text[], %s::bytea[]) AS u(t, p)
RETURNING id
"""

LEASE_MANY = """
UPDATE raw_item
   SET state = 'running', lease_owner = %(owner)s, lease_epoch = lease_epoch + 1,
       fencing_token = nextval('raw_fence'), lease_expires_at = now() + interval '120 seconds'
 WHERE id = ANY(%(ids)s) AND state = 'ready'
RETURNING id, lease_epoch, fencing_token
"""

COMMIT_MANY = """
UPDATE raw_item i SET state = 'succeeded', lease_expires_at = NULL
  FROM unnest(%(ids)s::bigint[], %(epochs)s::bigint[], %(tokens)s::bigint[]) AS u(id, epoch, token)
 WHERE i.id = u.id AND i.lease_owner = %(owner)s AND i.lease_epoch = u.epoch
   AND i.fencing_token = u.token AND i.lease_expires_at > now()
"""

BATCH = 100


def run(
    bootstrap: str, topic: str, dsn: str, wires: list[bytes], producer_config: dict[str, object]
) -> float:
    """Turns/s from the first insert until every turn is committed in the store."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"raw-store.{topic}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
        }
    )
    consumer.subscribe([topic])
    consumer.consume(1, timeout=3)  # join the group before the clock starts (nothing produced yet)
    done = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        producer = Producer(producer_config)
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for start in range(0, len(wires), BATCH):
                    chunk = wires[start : start + BATCH]
                    ids = conn.execute(
                        INSERT_MANY,
                        ([f"tenant-{(start + i) % 100}" for i in range(len(chunk))], [b"{}"] * len(chunk)),
                    ).fetchall()
                    for (item_id,), wire in zip(ids, chunk, strict=True):
                        while True:
                            try:
                                producer.produce(topic, value=wire, key=str(item_id).encode())
                                break
                            except BufferError:
                                producer.poll(0.01)
                    producer.poll(0)
            assert producer.flush(120) == 0
        except BaseException as exc:
            errors.append(exc)
            done.set()

    started = time.perf_counter()
    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    committed = 0
    deadline = time.monotonic() + 300
    with psycopg.connect(dsn, autocommit=True) as conn:
        while committed < len(wires) and time.monotonic() < deadline and not errors:
            messages = [m for m in consumer.consume(500, timeout=0.5) if m.error() is None]
            if not messages:
                continue
            ids = [int(m.key()) for m in messages]
            leased = conn.execute(LEASE_MANY, {"owner": "raw", "ids": ids}).fetchall()
            # the no-op turns
            conn.execute(
                COMMIT_MANY,
                {
                    "owner": "raw",
                    "ids": [r[0] for r in leased],
                    "epochs": [r[1] for r in leased],
                    "tokens": [r[2] for r in leased],
                },
            )
            committed += len(leased)
            last: dict[int, int] = {}
            for m in messages:
                last[m.partition()] = m.offset()
            consumer.commit(
                offsets=[TopicPartition(topic, p, o + 1) for p, o in last.items()], asynchronous=True
            )
    elapsed = time.perf_counter() - started
    thread.join(30)
    consumer.close()
    if errors:
        raise errors[0]
    assert committed >= len(wires), f"raw Kafka + store loop committed {committed} of {len(wires)}"
    return len(wires) / elapsed
