"""One way to open each Transport for the contract suites, and owners whose calls run on threads of
their own, as workers do: a transport may tie consumers to threads (Kafka does), and the contract
must hold either way.

``ALL_BACKENDS`` is every implementation, the in-process memory transport included.
``SCHEDULING_BACKENDS`` are those that also schedule (``not_before``, deadlines, priorities in
claim order, no second delivery on re-drive): every one but Kafka, which orders within a session
only and leaves a turn that is not due to the worker (see ``agent_dispatch.transport``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from agent_dispatch.settings import Backend, Settings
from agent_dispatch.transport import Delivery, OutboundTurn, Receipt, Transport
from agent_dispatch.transports import open_transport
from agent_dispatch.transports.memory import MemoryTransport

T = TypeVar("T")
SIGNING_KEY = "contract-suite-signing-key-0123456789abcdef"
#: Long enough for a slow CI machine to finish one step before a claim times out.
SHORT_VISIBILITY_S = 2.0


class MakeTransport(Protocol):
    def __call__(self, *, max_depth: int = ..., visibility_timeout_s: float = ...) -> Transport: ...


MEMORY = "memory"
SCHEDULING_BACKENDS = [
    pytest.param(MEMORY, id="memory"),
    pytest.param(Backend.SQLITE, id="sqlite"),
    pytest.param(Backend.POSTGRES, id="postgres", marks=pytest.mark.postgres),
]
ALL_BACKENDS = [*SCHEDULING_BACKENDS, pytest.param(Backend.KAFKA, id="kafka", marks=pytest.mark.kafka)]


def settings_for(request: pytest.FixtureRequest, tmp_path: Path, backend: Backend, **values: Any) -> Settings:
    """Settings that select ``backend`` on this test's services (and a store beside it)."""
    specific: dict[str, Any] = {}
    if backend is Backend.POSTGRES:
        specific["state_db_uri"] = request.getfixturevalue("postgres_dsn")
    elif backend is Backend.KAFKA:
        topic = request.getfixturevalue("kafka_topic_name")
        specific.update(
            kafka_bootstrap_servers=request.getfixturevalue("kafka_bootstrap"),
            kafka_topic=topic,
            kafka_group=f"group-{topic}",
            partitions=2,
        )
    return Settings(backend_choice=backend, signing_key=SIGNING_KEY, data_dir=tmp_path, **specific, **values)


def _opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeTransport]:
    backend: Backend | str = request.param
    opened: list[Transport] = []

    def make(*, max_depth: int = 1000, visibility_timeout_s: float = 120.0) -> Transport:
        transport: Transport
        if backend == MEMORY:
            transport = MemoryTransport(max_depth=max_depth, visibility_timeout_s=visibility_timeout_s)
        else:
            assert isinstance(backend, Backend)
            settings = settings_for(
                request, tmp_path, backend, max_depth=max_depth, visibility_timeout_s=visibility_timeout_s
            )
            transport = open_transport(settings)
        opened.append(transport)
        return transport

    yield make
    for transport in opened:
        transport.close()


@pytest.fixture(params=ALL_BACKENDS)
def make_transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeTransport]:
    yield from _opener(request, tmp_path)


@pytest.fixture(params=SCHEDULING_BACKENDS)
def make_scheduling_transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeTransport]:
    yield from _opener(request, tmp_path)


class Owner:
    """A worker identity whose calls all run on one dedicated thread."""

    def __init__(self, transport: Transport, name: str) -> None:
        self.transport = transport
        self.name = name
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._thread.submit(fn, *args, **kwargs).result(timeout=60)

    def claim(self, *, max_items: int = 1, wait_s: float = 0.0) -> list[Delivery]:
        return self._run(self.transport.claim, self.name, max_items=max_items, wait_s=wait_s)

    def claim_one(self, wait_s: float = 15.0) -> Delivery:
        got = self.claim(wait_s=wait_s)
        assert len(got) == 1, f"{self.name} expected one delivery within {wait_s}s, got {got}"
        return got[0]

    def collect(self, count: int, *, wait_s: float = 15.0) -> list[Delivery]:
        out: list[Delivery] = []
        deadline = time.monotonic() + wait_s
        while len(out) < count and time.monotonic() < deadline:
            out += self.claim(
                max_items=count - len(out), wait_s=min(1.0, max(deadline - time.monotonic(), 0))
            )
        return out

    def ack(self, receipt: Receipt) -> None:
        self._run(self.transport.ack, receipt)

    def release(self, receipt: Receipt, *, delay_s: float = 0.0) -> None:
        self._run(self.transport.release, receipt, delay_s=delay_s)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


@pytest.fixture
def owners() -> Iterator[Callable[[Transport, str], Owner]]:
    made: list[Owner] = []

    def make(transport: Transport, name: str) -> Owner:
        owner = Owner(transport, name)
        made.append(owner)
        return owner

    yield make
    for owner in made:
        owner.close()


def turn(
    n: int = 0,
    *,
    session: str | None = None,
    priority: int = 0,
    deadline: float | None = None,
    not_before: float | None = None,
) -> OutboundTurn:
    work_item_id = f"wi-{n}-{uuid.uuid4().hex[:8]}"
    return OutboundTurn(
        work_item_id=work_item_id,
        session_id=session or f"session-{n}",
        tenant="tenant-a",
        wire=f'{{"wire":"{work_item_id}"}}'.encode(),
        priority=priority,
        deadline=deadline,
        not_before=not_before,
    )


def eventually(check: Callable[[], bool], *, timeout: float = 15.0, polling: Owner | None = None) -> None:
    """Wait for ``check``. ``polling`` keeps claiming meanwhile, as a live worker does: a transport
    may settle acknowledgements from its consumer's own loop (Kafka commits offsets there)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        if polling is not None:
            assert polling.claim(wait_s=0.1) == [], "nothing should be left to claim"
        else:
            time.sleep(0.05)


def first_redelivery(candidates: list[Owner], *, within_s: float) -> tuple[Owner, Delivery]:
    """Poll every candidate until one is handed the delivery (Kafka may redeliver to either)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for owner in candidates:
            got = owner.claim(wait_s=0.25)
            if got:
                assert len(got) == 1
                return owner, got[0]
    raise AssertionError(f"no redelivery within {within_s}s")
