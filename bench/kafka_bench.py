"""Kafka transport benchmark: coalesced admission and the claim/ack loop against raw confluent-kafka.

One run, printed as ratios (rounds are interleaved and the median is reported, so drift on a busy
machine hits both sides of a ratio alike):

* put: ``KafkaTransport.admit`` from many threads (single turns, and ``put_many`` batches), each
  call returning only when the broker acknowledged its turns, against
  - a bare confluent-kafka producer loop (produce everything, flush once; goal >= 0.8x), and
  - the same producer flushing after every message (goal >= 20x).
* consume: committing every message's offset after consuming it, raw (consume a batch, commit
  the last offset) against the transport's claim/ack loop; pre-filled topic, one thread each.
* end to end: producing and consuming at the same time, raw (bare producer loop + raw consumer)
  against the transport (coalesced admitters + claim/ack loop), time until the last commit.

Usage: ``python bench/kafka_bench.py [--bootstrap HOST:PORT] [--messages N] ...``; without
``--bootstrap`` it starts a throwaway broker with testenv (cached jars, loopback).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from agent_dispatch.envelope import AgentTurnEnvelope, seal
from agent_dispatch.settings import load
from agent_dispatch.transport import OutboundTurn
from agent_dispatch.transports.kafka import WORK_ITEM_HEADER, KafkaTransport, KafkaTuning, ensure_topic

KEY = b"bench-signing-key-0123456789abcdef0123"

#: The raw clients' librdkafka log lines (reconnects, broker start-up) would interleave with the
#: figures; the transport routes its own through logging at DEBUG already.
_QUIET = logging.getLogger("bench.librdkafka")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


def make_turns(count: int, sessions: int = 1000) -> list[OutboundTurn]:
    """Real sealed envelopes (about 300 bytes), keyed by session like production traffic."""
    now = time.time()
    turns = []
    for i in range(count):
        session = f"session-{i % sessions}"
        env = AgentTurnEnvelope(
            job_id=f"job-{i}",
            session_id=session,
            kind="agent.turn",
            payload_ref=f"wi/{i}",
            tenant=f"tenant-{i % 17}",
            enqueued_at=now,
        )
        turns.append(
            OutboundTurn(work_item_id=f"wi-{i}", session_id=session, tenant=env.tenant, wire=seal(env, KEY))
        )
    return turns


def producer_config(bootstrap: str) -> dict[str, Any]:
    # The transport's durability settings, so the comparison is about coalescing, not acks.
    return {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,
        "partitioner": "murmur2_random",
        "queue.buffering.max.messages": 1_000_000,
        "socket.nagle.disable": True,
        "logger": _QUIET,
    }


class Bench:
    def __init__(self, bootstrap: str, partitions: int) -> None:
        self.bootstrap = bootstrap
        self.partitions = partitions
        self.admin = AdminClient({"bootstrap.servers": bootstrap, "logger": _QUIET})
        self.topics: list[str] = []

    def topic(self, tag: str) -> str:
        name = f"bench.{tag}.{uuid.uuid4().hex[:8]}"
        ensure_topic(self.admin, name, self.partitions)
        self.topics.append(name)
        return name

    def transport(self, topic: str, **tuning: Any) -> KafkaTransport:
        settings = load(
            backend_choice="kafka",
            kafka_bootstrap_servers=self.bootstrap,
            kafka_topic=topic,
            kafka_group=f"g.{topic}",
            partitions=self.partitions,
            max_depth=1_000_000_000,
        )
        transport = KafkaTransport(settings, tuning=KafkaTuning(**tuning))
        transport.ensure_ready()
        return transport

    def cleanup(self) -> None:
        if self.topics:
            for future in self.admin.delete_topics(self.topics, operation_timeout=30).values():
                with suppress(KafkaException):
                    future.result(timeout=60)

    # -- producing -----------------------------------------------------------------------------

    def bare_loop(self, turns: list[OutboundTurn], *, same_records: bool = True) -> float:
        """Produce everything, flush once. ``same_records``: with the transport's work-item header,
        so the ratio measures coalescing and confirmation, not a difference in record content."""
        topic = self.topic("bare")
        producer = Producer(producer_config(self.bootstrap))
        self._warm(producer, topic)
        started = time.perf_counter()
        for i, turn in enumerate(turns):
            headers = [(WORK_ITEM_HEADER, turn.work_item_id.encode())] if same_records else None
            while True:
                try:
                    producer.produce(topic, value=turn.wire, key=turn.session_id.encode(), headers=headers)
                    break
                except BufferError:
                    producer.poll(0.01)
            if i % 1000 == 0:
                producer.poll(0)
        left = producer.flush(120)
        elapsed = time.perf_counter() - started
        assert left == 0, f"{left} messages undelivered"
        return len(turns) / elapsed

    def flush_each(self, turns: list[OutboundTurn]) -> float:
        topic = self.topic("flush")
        producer = Producer(producer_config(self.bootstrap))
        self._warm(producer, topic)
        started = time.perf_counter()
        for turn in turns:
            producer.produce(topic, value=turn.wire, key=turn.session_id.encode())
            producer.flush(30)
        return len(turns) / (time.perf_counter() - started)

    def coalesced(self, turns: list[OutboundTurn], threads: int, batch: int) -> float:
        topic = self.topic(f"put{batch}")
        transport = self.transport(topic)
        try:
            transport.admit(turns[:1])  # producer start-up (InitProducerId) is not throughput
            chunks = [turns[i : i + batch] for i in range(1, len(turns), batch)]
            barrier = threading.Barrier(threads + 1)
            index = iter(range(len(chunks)))
            lock = threading.Lock()

            def submitter() -> None:
                barrier.wait()
                while True:
                    with lock:
                        i = next(index, None)
                    if i is None:
                        return
                    transport.admit(chunks[i])

            with ThreadPoolExecutor(max_workers=threads) as pool:
                futures = [pool.submit(submitter) for _ in range(threads)]
                barrier.wait()
                started = time.perf_counter()
                for future in futures:
                    future.result()
                elapsed = time.perf_counter() - started
            return (len(turns) - 1) / elapsed
        finally:
            transport.close()

    @staticmethod
    def _warm(producer: Producer, topic: str) -> None:
        producer.produce(topic, value=b"warm-up", key=b"warm-up")
        producer.flush(30)

    # -- consuming -----------------------------------------------------------------------------

    def fill(self, topic: str, turns: list[OutboundTurn]) -> None:
        producer = Producer(producer_config(self.bootstrap))
        for turn in turns:
            while True:
                try:
                    producer.produce(
                        topic,
                        value=turn.wire,
                        key=turn.session_id.encode(),
                        headers=[(WORK_ITEM_HEADER, turn.work_item_id.encode())],
                    )
                    break
                except BufferError:
                    producer.poll(0.01)
        assert producer.flush(120) == 0

    def raw_consume(self, topic: str, count: int, batch: int = 500) -> float:
        """consume() a batch, commit the batch's last offsets asynchronously: the ceiling."""
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"raw.{topic}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "partition.assignment.strategy": "cooperative-sticky",
                "logger": _QUIET,
            }
        )
        consumer.subscribe([topic])
        got = 0
        started: float | None = None
        deadline = time.monotonic() + 300
        while got < count and time.monotonic() < deadline:
            messages = consumer.consume(batch, timeout=0.5)
            if not messages:
                continue
            if started is None:
                started = time.perf_counter()  # group join is not throughput
            last: dict[int, int] = {}
            for message in messages:
                if message.error() is None:
                    got += 1
                    last[message.partition()] = message.offset()
            consumer.commit(
                offsets=[TopicPartition(topic, p, o + 1) for p, o in last.items()], asynchronous=True
            )
        elapsed = time.perf_counter() - (started or time.perf_counter())
        consumer.close()
        assert got >= count, f"raw consumer got {got} of {count}"
        return count / elapsed

    def transport_consume(self, transport: KafkaTransport, count: int, batch: int = 500) -> float:
        got = 0
        started: float | None = None
        deadline = time.monotonic() + 300
        seen: set[str] = set()
        while len(seen) < count and time.monotonic() < deadline:
            deliveries = transport.claim("bench", max_items=batch, wait_s=0.5)
            if deliveries and started is None:
                started = time.perf_counter()
            for delivery in deliveries:
                seen.add(delivery.work_item_id)
                transport.ack(delivery.receipt)
            got += len(deliveries)
        elapsed = time.perf_counter() - (started or time.perf_counter())
        assert len(seen) >= count, f"transport consumer got {len(seen)} of {count}"
        return count / elapsed

    def consume_pair(self, turns: list[OutboundTurn]) -> tuple[float, float]:
        topic = self.topic("consume")
        self.fill(topic, turns)
        raw = self.raw_consume(topic, len(turns))
        transport = self.transport(topic)
        try:
            ours = self.transport_consume(transport, len(turns))
        finally:
            transport.close()
        return raw, ours

    # -- end to end ----------------------------------------------------------------------------

    def e2e_raw(self, turns: list[OutboundTurn]) -> float:
        topic = self.topic("e2e-raw")
        consumer_rate: list[float] = []
        with self._consumer_ready(lambda: consumer_rate.append(self.raw_consume(topic, len(turns)))) as ready:
            ready.wait(5)
            started = time.perf_counter()
            self.bare_produce_to(topic, turns)
        return len(turns) / (time.perf_counter() - started)

    def e2e_transport(self, turns: list[OutboundTurn], threads: int, batch: int) -> float:
        topic = self.topic("e2e-ours")
        transport = self.transport(topic)
        try:
            transport.admit(turns[:1])
            rest = turns[1:]
            with self._consumer_ready(lambda: self.transport_consume(transport, len(turns))) as ready:
                ready.wait(5)
                started = time.perf_counter()
                chunks = [rest[i : i + batch] for i in range(0, len(rest), batch)]
                with ThreadPoolExecutor(max_workers=threads) as pool:
                    list(pool.map(transport.admit, chunks))
            return len(turns) / (time.perf_counter() - started)
        finally:
            transport.close()

    def bare_produce_to(self, topic: str, turns: list[OutboundTurn]) -> None:
        producer = Producer(producer_config(self.bootstrap))
        for i, turn in enumerate(turns):
            while True:
                try:
                    producer.produce(topic, value=turn.wire, key=turn.session_id.encode())
                    break
                except BufferError:
                    producer.poll(0.01)
            if i % 1000 == 0:
                producer.poll(0)
        assert producer.flush(120) == 0

    @contextmanager
    def _consumer_ready(self, run: Callable[[], object]) -> Iterator[threading.Event]:
        """Run the consumer on its own thread; the with-block ends when it has consumed everything."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def body() -> None:
            ready.set()
            try:
                run()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        # Give the consumer a head start to join its group, so the run measures flow, not joins.
        time.sleep(3)
        yield ready
        thread.join(timeout=300)
        if errors:
            raise errors[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", help="an existing broker; default: start one with testenv")
    parser.add_argument("--messages", type=int, default=100_000, help="turns per throughput run")
    parser.add_argument(
        "--flush-messages", type=int, default=1_000, help="turns for the flush-per-message run"
    )
    parser.add_argument("--threads", type=int, default=64, help="threads admitting one turn per call")
    parser.add_argument("--batch-threads", type=int, default=16, help="threads admitting put_many batches")
    parser.add_argument("--batch", type=int, default=100, help="turns per put_many call")
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    args = parser.parse_args()

    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        from testenv.kafka import KafkaBroker

        broker = KafkaBroker().start()
        bootstrap = broker.bootstrap
    bench = Bench(bootstrap, args.partitions)
    turns = make_turns(args.messages)
    results: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)
        print(f"  {name:<44} {value:>12,.0f} turns/s", flush=True)

    try:
        print(
            f"cpus={os.cpu_count()} messages={args.messages} threads={args.threads} "
            f"batch-threads={args.batch_threads} batch={args.batch} "
            f"partitions={args.partitions} payload={len(turns[0].wire)}B rounds={args.rounds}"
        )
        for round_no in range(1, args.rounds + 1):
            print(f"round {round_no}", flush=True)
            record("bare producer loop (flush once)", bench.bare_loop(turns))
            record("bare loop, no header (reference)", bench.bare_loop(turns, same_records=False))
            record(
                f"transport admit, 1 turn/call, {args.threads} threads",
                bench.coalesced(turns, args.threads, 1),
            )
            record(
                f"transport put_many, {args.batch}/call, {args.batch_threads} threads",
                bench.coalesced(turns, args.batch_threads, args.batch),
            )
            record("producer flushing every message", bench.flush_each(turns[: args.flush_messages]))
            raw, ours = bench.consume_pair(turns)
            record("raw consume + commit per batch", raw)
            record("transport claim/ack loop", ours)
            record("end to end raw", bench.e2e_raw(turns))
            record("end to end transport", bench.e2e_transport(turns, args.batch_threads, args.batch))
    finally:
        bench.cleanup()
        if broker is not None:
            broker.close()

    med = {name: statistics.median(values) for name, values in results.items()}
    bare = med["bare producer loop (flush once)"]
    flush = med["producer flushing every message"]
    single = med[f"transport admit, 1 turn/call, {args.threads} threads"]
    many = med[f"transport put_many, {args.batch}/call, {args.batch_threads} threads"]
    print("\nmedians (turns/s):")
    for name, value in med.items():
        print(f"  {name:<44} {value:>12,.0f}")
    print("\nratios:")
    rows = [
        ("put_many coalesced / bare producer loop", many / bare, 0.8),
        ("single-turn coalesced / bare producer loop", single / bare, 0.8),
        (
            "put_many coalesced / bare loop without header",
            many / med["bare loop, no header (reference)"],
            None,
        ),
        ("put_many coalesced / flush per message", many / flush, 20.0),
        ("single-turn coalesced / flush per message", single / flush, 20.0),
        (
            "claim/ack loop / raw consume+commit",
            med["transport claim/ack loop"] / med["raw consume + commit per batch"],
            None,
        ),
        ("end to end transport / raw", med["end to end transport"] / med["end to end raw"], None),
    ]
    for name, ratio, goal in rows:
        verdict = "" if goal is None else (f"  goal >= {goal:g}x: " + ("met" if ratio >= goal else "NOT met"))
        print(f"  {name:<44} {ratio:>7.2f}x{verdict}")


if __name__ == "__main__":
    main()
