"""Worker processes against real backends: start, signal, kill, and wait for outcomes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_dispatch import dispatch
from agent_dispatch.models import SubmitRequest, WorkItem, WorkState
from agent_dispatch.settings import Settings, load
from agent_dispatch.store import WorkItemStore
from agent_dispatch.stores import open_store
from agent_dispatch.transport import Transport
from agent_dispatch.transports import open_transport

ROOT = Path(__file__).resolve().parents[2]
KEY = "e2e-signing-key-" + "x" * 32
BASE_ENV = {
    k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "TASK_QUEUE", "STATE_DB", "KAFKA_"))
}


@dataclass
class Backend:
    """Environment for one backend; ``settings()`` gives the same configuration in-process."""

    name: str
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def settings(self, **extra: Any) -> Settings:
        saved = dict(os.environ)
        try:
            os.environ.update(self.env)
            return load(**extra)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def open(self) -> tuple[Settings, WorkItemStore, Transport]:
        settings = self.settings()
        store = open_store(settings)
        store.migrate()
        transport = open_transport(settings)
        transport.ensure_ready()
        return settings, store, transport


def backend_env(name: str, tmp_path: Path, request: Any, **overrides: str) -> Backend:
    env = {
        "AGENT_DISPATCH_SIGNING_KEY": KEY,
        "AGENT_DISPATCH_DATA_DIR": str(tmp_path / "data"),
        "AGENT_DISPATCH_CLAIM_TTL_S": "6",
        "AGENT_DISPATCH_RENEW_INTERVAL_S": "1",
        "AGENT_DISPATCH_VISIBILITY_TIMEOUT_S": "8",
        "AGENT_DISPATCH_SWEEP_INTERVAL_S": "1",
        "AGENT_DISPATCH_LOG_LEVEL": "WARNING",
        "AGENT_DISPATCH_METRICS_PORT": "0",
        "AGENT_DISPATCH_SHUTDOWN_GRACE_S": "5",
    }
    if name == "sqlite":
        env["TASK_QUEUE_BACKEND"] = "sqlite"
    elif name == "postgres":
        env["TASK_QUEUE_BACKEND"] = "postgres"
        env["STATE_DB_URI"] = request.getfixturevalue("postgres_dsn")
    elif name == "kafka":
        env["TASK_QUEUE_BACKEND"] = "kafka"
        env["STATE_DB_URI"] = request.getfixturevalue("postgres_dsn")
        env["KAFKA_BOOTSTRAP_SERVERS"] = request.getfixturevalue("kafka_bootstrap")
        env["AGENT_DISPATCH_KAFKA_TOPIC"] = request.getfixturevalue("kafka_topic_name")
        env["AGENT_DISPATCH_KAFKA_GROUP"] = f"e2e-{uuid.uuid4().hex[:8]}"
        env["AGENT_TURNS_PARTITIONS"] = "4"
    env.update(overrides)
    return Backend(name, env)


def start_worker(
    backend: Backend, *, sink_url: str, concurrency: int = 4, log: Path, extra: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    env = {
        **BASE_ENV,
        **backend.env,
        "AGENT_DISPATCH_EXECUTOR": "tests.e2e.recording:run",
        "AGENT_DISPATCH_TEST_SINK": sink_url,
        "PYTHONPATH": str(ROOT),
        **(extra or {}),
    }
    out = log.open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_dispatch.cli", "worker", "--concurrency", str(concurrency)],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    backend.procs.append(proc)
    return proc


def stop_all(backend: Backend) -> None:
    for proc in backend.procs:
        if proc.poll() is None:
            with _suppress():
                os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
    for proc in backend.procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def submit(
    settings: Settings,
    store: WorkItemStore,
    transport: Transport,
    n: int,
    *,
    tenant: str = "acme",
    payload: bytes = b"{}",
    session: Callable[[int], str] | None = None,
) -> list[WorkItem]:
    items = []
    for i in range(n):
        request = SubmitRequest(
            tenant=tenant,
            kind="turn",
            payload=payload,
            session_id=session(i) if session else None,
            idempotency_key=f"e2e-{i}-{uuid.uuid4().hex[:6]}",
        )
        items.append(
            dispatch.enqueue(store, transport, request, signing_key=KEY.encode(), settings=settings).item
        )
    return items


def wait_states(
    store: WorkItemStore, ids: list[str], states: set[WorkState], timeout: float, what: str = "items settle"
) -> dict[str, WorkItem]:
    deadline = time.monotonic() + timeout
    pending = set(ids)
    settled: dict[str, WorkItem] = {}
    while pending and time.monotonic() < deadline:
        for item_id in list(pending):
            item = store.get(item_id)
            if item.state in states:
                settled[item_id] = item
                pending.discard(item_id)
        if pending:
            time.sleep(0.2)
    if pending:
        sample = [(i, store.get(i).state.value) for i in list(pending)[:5]]
        raise AssertionError(f"timed out waiting for {what}: {len(pending)} pending, e.g. {sample}")
    return settled


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass(frozen=True)
class Answer:
    """The gateway's answer to one ``POST /api/turns``."""

    #: HTTP status; ``None``: refused, reset or timed out, so the outcome is unknown (retry the key).
    status: int | None
    #: The job handle of a 2xx answer (``{}`` otherwise).
    handle: dict[str, Any]
    #: What a refusal said (status and the start of its body, or why it was unreachable).
    refusal: str | None = None


def post_turn(port: int, token: str, body: dict[str, Any], key: str, *, timeout_s: float) -> Answer:
    """``POST /api/turns`` on the loopback gateway with a bearer token and an Idempotency-Key."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/turns",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
            "Idempotency-Key": key,
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, answer = int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return Answer(int(exc.code), {}, f"{exc.code} {exc.read()[:300]!r}")
    except OSError as exc:  # URLError is an OSError
        return Answer(None, {}, f"unreachable {exc}")
    try:
        handle = json.loads(answer)
    except ValueError:
        handle = {}
    return Answer(status, handle if isinstance(handle, dict) else {})
