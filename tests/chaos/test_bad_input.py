"""Bad input (issue 10): fuzzed envelopes on every transport, invalid AgentDispatch specs, and
oversized payloads. Not marked ``chaos``: these always run.

Where the rest lives (not duplicated here):
- invalid settings: ``tests/test_settings.py`` gives every variable in ``settings.ALLOWED`` an
  invalid value and checks the one-line message naming it, and exit code 2 from the doctor, the
  worker, ``migrate`` and the gateway;
- the gateway fuzzed from its OpenAPI document: ``tests/gateway/test_openapi_fuzz.py``;
- 19 invalid AgentDispatch specs, an over-long name and 3 refused updates:
  ``tests/kube/test_crd.py``; the cases below are fields that file does not cover.
"""

from __future__ import annotations

import base64
import json
import random
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_dispatch import dispatch
from agent_dispatch.envelope import MAX_ENVELOPE_BYTES, AgentTurnEnvelope, open_envelope, seal
from agent_dispatch.errors import NotFound, PoisonEnvelope
from agent_dispatch.lease import WorkItemLeaseGuard
from agent_dispatch.models import SubmitRequest, WorkItem, WorkState
from agent_dispatch.settings import Settings
from agent_dispatch.store import WorkItemStore
from agent_dispatch.transport import Delivery, OutboundTurn, Transport
from agent_dispatch.worker import Worker
from testenv._common import free_port
from tests.chaos.kube_support import install_crd
from tests.e2e.harness import KEY, Backend, backend_env, start_worker, stop_all, wait_states, wait_until
from tests.e2e.sink import FencingSink

pytestmark = pytest.mark.timeout(300)

TRANSPORTS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("kafka", id="kafka", marks=[pytest.mark.kafka, pytest.mark.postgres]),
]
EXAMPLES = {"sqlite": 60, "postgres": 40, "kafka": 15}
TENANT = "acme"


# --- what a fuzzed wire should become -------------------------------------------------------


def is_poison(store: WorkItemStore, wire: bytes) -> bool:
    """The oracle: unverifiable, malformed, oversized, orphaned or cross-tenant means poison.

    A mutation that leaves the envelope's canonical form intact (whitespace, key order, ``1.50``
    for ``1.5``) still verifies: that is the same turn, and it must run like one.
    """
    try:
        envelope = open_envelope(wire, KEY.encode())
    except PoisonEnvelope:
        return True
    try:
        item = store.get(envelope.job_id)
    except NotFound:
        return True
    return item.tenant != envelope.tenant


def base_envelope(item: WorkItem, **changes: Any) -> AgentTurnEnvelope:
    values: dict[str, Any] = {
        "job_id": item.id,
        "session_id": item.session_id,
        "kind": item.kind,
        "payload_ref": item.id,
        "tenant": item.tenant,
        "enqueued_at": 1_700_000_000.5,
        **changes,
    }
    return AgentTurnEnvelope(**values)


def wire_strategy(item: WorkItem) -> st.SearchStrategy[bytes]:
    """Random bytes, mutated valid envelopes, wrong signatures, forged fields, oversized wires."""
    valid_env = base_envelope(item)
    valid = seal(valid_env, KEY.encode())
    outer = json.loads(valid)
    fields = sorted(valid_env.model_dump())
    junk_value = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True),
        st.text(max_size=40),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    )

    def overwrite(args: tuple[int, bytes]) -> bytes:
        at, patch = args
        return valid[:at] + patch + valid[at + len(patch) :]

    def flip(args: tuple[int, int]) -> bytes:
        at, bit = args
        data = bytearray(valid)
        data[at] ^= 1 << bit
        return bytes(data)

    def with_field(args: tuple[str, Any]) -> bytes:
        name, value = args
        env = dict(outer["env"], **{name: value})
        return json.dumps({"v": 1, "env": env, "sig": outer["sig"]}).encode()

    def without(name: str) -> bytes:
        return json.dumps({k: v for k, v in outer.items() if k != name}).encode()

    def resealed(key: bytes) -> bytes:
        return seal(valid_env, key)

    def forged(args: tuple[str, str]) -> bytes:
        name, value = args
        return seal(base_envelope(item, **{name: value}), KEY.encode())

    def padded(size: int) -> bytes:
        return valid[:-1] + b"," + json.dumps("p" * size).encode() + b":1}"

    return st.one_of(
        st.binary(max_size=600),
        st.text(max_size=200).map(str.encode),
        st.integers(0, len(valid) - 1).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, len(valid) - 1), st.binary(min_size=1, max_size=6)).map(overwrite),
        st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 7)).map(flip),
        st.tuples(st.sampled_from(fields), junk_value).map(with_field),
        st.sampled_from(["v", "env", "sig"]).map(without),
        st.sampled_from([0, 2, "1", None]).map(lambda v: json.dumps({**outer, "v": v}).encode()),
        st.text(max_size=60).map(lambda sig: json.dumps({**outer, "sig": sig}).encode()),
        st.binary(min_size=16, max_size=64).filter(lambda k: k != KEY.encode()).map(resealed),
        st.tuples(st.sampled_from(["tenant", "job_id"]), st.sampled_from(["other", "no-such-item"])).map(
            forged
        ),
        st.integers(MAX_ENVELOPE_BYTES - 200, 3 * MAX_ENVELOPE_BYTES).map(padded),
        st.just(json.dumps({**outer, "extra": 1}).encode()),
        # The same turn re-encoded: different bytes, same canonical envelope (must still run).
        st.just(json.dumps(outer, indent=2, sort_keys=False).encode()),
    )


# --- an in-process worker over a real transport ------------------------------------------------


@dataclass
class Rig:
    name: str
    settings: Settings
    store: WorkItemStore
    transport: Transport
    worker: Worker
    item: WorkItem
    ran: list[str] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)

    def claim_all(self, count: int, timeout: float = 60.0) -> list[Delivery]:
        deliveries: list[Delivery] = []
        deadline = time.monotonic() + timeout
        while len(deliveries) < count:
            assert time.monotonic() < deadline, f"only {len(deliveries)} of {count} deliveries arrived"
            deliveries.extend(self.transport.claim("fuzz/0", max_items=count - len(deliveries), wait_s=1.0))
        return deliveries


@pytest.fixture(params=TRANSPORTS)
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    backend = backend_env(request.param, tmp_path, request, AGENT_DISPATCH_MAX_DEPTH="100000")
    settings_, store, transport = backend.open()
    ran: list[str] = []

    def executor(env: AgentTurnEnvelope, payload: bytes, guard: WorkItemLeaseGuard, log: Any) -> None:
        guard.side_effect(ran.append, env.job_id)

    worker = Worker(settings_, store, transport, executor, signing_key=KEY.encode(), concurrency=1)
    # A real WorkItem that mutated envelopes name (nothing is admitted for it up front).
    item = store.submit(SubmitRequest(tenant=TENANT, kind="turn", payload=b"{}", session_id="fuzz")).item
    try:
        yield Rig(request.param, settings_, store, transport, worker, item, ran)
    finally:
        transport.close()
        store.close()


def test_fuzzed_envelopes_become_poison_and_the_worker_carries_on(rig: Rig) -> None:
    @settings(
        max_examples=EXAMPLES[rig.name],
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(wires=st.lists(wire_strategy(rig.item), min_size=1, max_size=6))
    def check(wires: list[bytes]) -> None:
        rig.transport.admit(
            [
                OutboundTurn(f"fuzz-{uuid.uuid4().hex[:12]}", f"fuzz-{n}", TENANT, wire)
                for n, wire in enumerate(wires)
            ]
        )
        for delivery in rig.claim_all(len(wires)):
            expected_poison = is_poison(rig.store, delivery.wire)
            result = rig.worker.handle("fuzz/0", delivery)  # never raises
            rig.outcomes[result] = rig.outcomes.get(result, 0) + 1
            if expected_poison:
                assert result == "poison", (delivery.wire[:200], result)
            else:
                assert result != "poison", (delivery.wire[:200], result)
        if rig.name != "kafka":  # Kafka commits acknowledgements in the background: checked below
            assert rig.transport.depth() == 0, "every fuzzed delivery was acknowledged"

    check()
    assert rig.outcomes.get("poison", 0) > 0, rig.outcomes
    # The real item ran at most once, however many re-encodings of its envelope arrived.
    assert rig.ran.count(rig.item.id) <= 1
    # The worker is not stuck: a valid turn submitted after the fuzz completes.
    valid = dispatch.enqueue(
        rig.store,
        rig.transport,
        SubmitRequest(tenant=TENANT, kind="turn", payload=b"{}", idempotency_key=uuid.uuid4().hex),
        signing_key=KEY.encode(),
        settings=rig.settings,
    ).item
    results = [rig.worker.handle("fuzz/0", d) for d in rig.claim_all(1)]
    assert results == ["succeeded"], results
    assert rig.store.get(valid.id).state is WorkState.SUCCEEDED
    wait_until(lambda: rig.transport.depth() == 0, 60, "every delivery acknowledged")


# --- a burst of bad envelopes into a real worker process ----------------------------------------


def random_bad_wires(item: WorkItem, rng: random.Random, count: int) -> list[bytes]:
    valid = seal(base_envelope(item), KEY.encode())
    makers = [
        lambda: rng.randbytes(rng.randrange(0, 300)),
        lambda: valid[: rng.randrange(0, len(valid))],
        lambda: valid.replace(b'"sig":"', b'"sig":"A', 1),
        lambda: seal(base_envelope(item), rng.randbytes(40)),
        lambda: seal(base_envelope(item, tenant="intruder"), KEY.encode()),
        lambda: seal(base_envelope(item, job_id=f"ghost-{rng.randrange(10**6)}"), KEY.encode()),
        lambda: b"{}",
        lambda: b"null",
        lambda: b'{"v":1,"env":{},"sig":"x"}',
        lambda: base64.b64encode(valid),
        lambda: valid + b" " * MAX_ENVELOPE_BYTES,
    ]
    return [rng.choice(makers)() for _ in range(count)]


def scrape_poison(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith('agent_dispatch_turns_total{outcome="poison"}'):
                return float(line.split()[-1])
    return -1.0


@pytest.fixture(params=TRANSPORTS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    chosen = backend_env(request.param, tmp_path, request)
    yield chosen
    stop_all(chosen)


def produce_raw(backend: Backend, rng: random.Random, count: int) -> None:
    """What a process with write access to the topic could send: no header, odd keys, no value."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": backend.env["KAFKA_BOOTSTRAP_SERVERS"]})
    topic = backend.env["AGENT_DISPATCH_KAFKA_TOPIC"]
    for n in range(count):
        headers = rng.choice([None, [("agent-dispatch-work-item", rng.randbytes(8))], [("x", b"y")]])
        value = rng.choice([None, b"", rng.randbytes(rng.randrange(1, 200))])
        producer.produce(topic, key=rng.randbytes(4) if n % 2 else None, value=value, headers=headers)
    assert producer.flush(30) == 0


def test_a_burst_of_bad_envelopes_never_stops_a_worker_process(backend: Backend, tmp_path: Path) -> None:
    settings_, store, transport = backend.open()
    sink = FencingSink().start()
    try:
        # A real item the forgeries name; cancelled, so the recovery sweep leaves it alone.
        item = store.submit(SubmitRequest(tenant=TENANT, kind="turn", payload=b"{}")).item
        store.cancel(item.id, tenant=TENANT, reason="a target for forgeries")
        rng = random.Random(10)
        wires = random_bad_wires(item, rng, 40)
        assert all(is_poison(store, wire) for wire in wires)
        transport.admit([OutboundTurn(f"bad-{n}", f"bad-{n}", TENANT, w) for n, w in enumerate(wires)])
        poison = len(wires)
        if backend.name == "kafka":
            produce_raw(backend, rng, 10)
            poison += 10
        port = free_port()
        proc = start_worker(
            backend,
            sink_url=sink.url,
            concurrency=2,
            log=tmp_path / "worker.log",
            extra={"AGENT_DISPATCH_METRICS_PORT": str(port)},
        )
        good = [
            dispatch.enqueue(
                store,
                transport,
                SubmitRequest(tenant=TENANT, kind="turn", payload=b"{}", idempotency_key=f"good-{n}"),
                signing_key=KEY.encode(),
                settings=settings_,
            ).item
            for n in range(3)
        ]
        wait_states(store, [g.id for g in good], {WorkState.SUCCEEDED}, timeout=120)
        wait_until(lambda: transport.depth() == 0, 60, "every bad envelope acknowledged")
        wait_until(lambda: scrape_poison(port) == poison, 30, f"{poison} poison deliveries counted")
        assert proc.poll() is None, "the worker process is still running"
        assert store.get(item.id).state is WorkState.CANCELLED, "no forgery touched the real item"
        assert item.id not in sink.accepted
    finally:
        sink.stop()
        transport.close()
        store.close()


# --- invalid AgentDispatch specs: the fields tests/kube/test_crd.py does not cover ---------------

MORE_INVALID_SPECS: list[tuple[str, str, Any, str]] = [
    ("zero partitions", "partitions", 0, "spec.partitions"),
    ("too many partitions", "partitions", 10_001, "spec.partitions"),
    ("zero sweep interval", "sweepIntervalSeconds", 0, "spec.sweepIntervalSeconds"),
    ("attempts above 100", "maxAttempts", 101, "spec.maxAttempts"),
    ("zero concurrency", "worker.concurrency", 0, "spec.worker.concurrency"),
    ("negative replicas", "worker.replicas", -1, "spec.worker.replicas"),
    ("executor is a shell command", "worker.executor", {"name": "rm -rf /"}, "spec.worker.executor.name"),
    (
        "executor url not http",
        "worker.executor",
        {"name": "http", "url": "ftp://x"},
        "spec.worker.executor.url",
    ),
    ("metrics port 70000", "worker.metricsPort", 70_000, "spec.worker.metricsPort"),
    ("unknown log level", "worker.logLevel", "TRACE", "spec.worker.logLevel"),
    ("unknown autoscaling mode", "autoscaling", {"mode": "vpa"}, "spec.autoscaling.mode"),
    (
        "zero depth per replica",
        "autoscaling",
        {"mode": "keda", "targetDepthPerReplica": 0},
        "spec.autoscaling.targetDepthPerReplica",
    ),
    ("topic name with spaces", "kafka.topic", "bad topic!", "spec.kafka.topic"),
    ("bootstrap servers without a port", "kafka.bootstrapServers", "broker", "spec.kafka.bootstrapServers"),
]


@pytest.mark.kube
@pytest.mark.parametrize(
    ("label", "path", "value", "field_name"), MORE_INVALID_SPECS, ids=[c[0] for c in MORE_INVALID_SPECS]
)
def test_more_invalid_specs_are_rejected_naming_the_field(
    request: pytest.FixtureRequest, label: str, path: str, value: Any, field_name: str
) -> None:
    from tests.kube.conftest import agentdispatch, kubectl_apply
    from tests.kube.test_crd import with_

    kube = request.getfixturevalue("kube")
    namespace = request.getfixturevalue("kube_namespace")
    install_crd(kube)
    result = kubectl_apply(kube, namespace, agentdispatch("bad", with_(path, value)), check=False)
    assert result.returncode != 0, f"{label}: the API server accepted it"
    assert field_name in result.stderr, f"{label}: {result.stderr}"


# --- oversized payloads: 413, and nothing stored or queued -------------------------------------


@pytest.mark.parametrize("transport_name", TRANSPORTS)
def test_oversized_payloads_are_413_and_store_nothing(
    transport_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from tests.gateway._harness import TOKENS, gateway_settings, running_gateway

    extra: dict[str, Any] = {"max_payload_bytes": 512}
    dsn = None
    if transport_name in {"postgres", "kafka"}:
        dsn = request.getfixturevalue("postgres_dsn")
    if transport_name == "kafka":
        extra |= {
            "state_db_uri": dsn,
            "kafka_bootstrap_servers": request.getfixturevalue("kafka_bootstrap"),
            "kafka_topic": request.getfixturevalue("kafka_topic_name"),
            "kafka_group": f"oversize-{uuid.uuid4().hex[:8]}",
            "partitions": 1,
        }
    with running_gateway(gateway_settings(transport_name, tmp_path / "gw", dsn, **extra)) as gw:
        gw.transport.ensure_ready()
        over = "x" * 600
        assert gw.submit({"kind": "t", "payload": over}).status == 413
        assert gw.submit({"kind": "t", "payload": {"k": over}}, key="same-key").status == 413
        huge = json.dumps({"kind": "t", "payload": "y" * (256 * 1024)}).encode()
        assert gw.call("POST", "/api/turns", raw=huge).status == 413
        assert gw.chunked("/api/turns", [b'{"kind": "t", "payload": "', b"z" * 8192, b'"}']).status == 413
        reply = gw.call("POST", "/api/turns:batch", body={"turns": [{"kind": "t", "payload": over}] * 3})
        assert reply.status in {200, 413}
        if reply.status == 200:
            assert {r["status"] for r in reply.json()["results"]} == {413}
        # Nothing stored for any tenant, nothing queued.
        for tenant in TOKENS:
            assert gw.store.list_items(tenant=tenant, limit=10) == []
        assert gw.transport.depth() == 0
        # The same key then works with a payload in bounds: the refusal left no trace behind it.
        accepted = gw.submit({"kind": "t", "payload": {"k": "small"}}, key="same-key")
        assert accepted.status == 202 and accepted.json()["created"] is True


def test_a_signature_with_non_ascii_characters_is_poison_not_a_type_error() -> None:
    """Found by the fuzzer: ``hmac.compare_digest`` raised TypeError on such a str, which escaped
    as an unexpected error, so the delivery was released and redelivered for ever."""
    item_env = AgentTurnEnvelope(
        job_id="j", session_id="s", kind="turn", payload_ref="j", tenant=TENANT, enqueued_at=1.0
    )
    outer = json.loads(seal(item_env, KEY.encode()))
    outer["sig"] = "\u00e9" + outer["sig"][1:]
    with pytest.raises(PoisonEnvelope, match="signature"):
        open_envelope(json.dumps(outer).encode(), KEY.encode())
