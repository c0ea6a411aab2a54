"""Chaos harness: worker processes, a gateway process and HTTP clients over one transport, faults
injected at seeded random times, and the invariants checked over everything that happened.

It reuses tests/e2e: ``backend_env``/``start_worker`` (the ``tests.e2e.recording:run`` executor,
whose one side effect goes through ``lease_guard.side_effect`` to the fencing sink) and the
``FencingSink``. What it adds: a gateway subprocess on a fixed port (so clients reconnect after a
restart), clients that retry ambiguous submissions with the same Idempotency-Key, a fault
scheduler, a depth and metrics sampler, and :meth:`ChaosRun.verify`.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_dispatch.gateway import hash_token, write_tokens_file
from agent_dispatch.models import WorkItem, WorkState, deterministic_id
from agent_dispatch.settings import RTO_S
from agent_dispatch.store import CountsUnfinished
from testenv._common import free_port, port_open
from tests.chaos.kafka_support import REPLICATED, REPLICATED_FAULTS, QuorumWatch
from tests.chaos.parts import (
    ClientStats,
    Services,
    TimedSink,
    WorkerProc,
    _py_spy_dump,
    _retry,
    scrape,
)
from tests.e2e.harness import BASE_ENV, ROOT, Backend, post_turn, start_worker

TENANT = "chaos"
TOKEN = "chaos-token-0123456789abcdef"
#: Small on purpose: clients push against the bound, so admission is exercised under faults.
MAX_DEPTH = 24
WORKERS = 3
CONCURRENCY = 2
CLIENTS = 4
SESSIONS_PER_CLIENT = 8
TERMINAL = frozenset({WorkState.SUCCEEDED, WorkState.FAILED, WorkState.CANCELLED, WorkState.DEAD_LETTER})

FAULTS_BY_TRANSPORT: dict[str, tuple[str, ...]] = {
    "sqlite": ("worker_kill", "worker_stop", "gateway_restart"),
    "postgres": ("worker_kill", "worker_stop", "gateway_restart", "postgres_restart"),
    # The Kafka transport keeps its WorkItems in PostgreSQL: both servers get restarted.
    "kafka": ("worker_kill", "worker_stop", "gateway_restart", "postgres_restart", "kafka_restart"),
    # Three brokers, replication factor 3, min.insync.replicas=2 (tests/chaos/kafka_support.py).
    # The worker and gateway faults that matter here are the ones that meet broker faults:
    # the single-broker run above covers the rest, and the short mode's time stays bounded.
    REPLICATED: ("worker_kill", "gateway_restart", *REPLICATED_FAULTS),
}


class ChaosRun:
    """One transport under load and faults; ``run()`` then ``verify()``."""

    def __init__(
        self,
        transport_name: str,
        backend: Backend,
        tmp_path: Path,
        *,
        seed: int,
        duration_s: float,
        services: Services,
        log: Callable[[str], None] = print,
    ) -> None:
        self.name = transport_name
        self.backend = backend
        self.tmp = tmp_path
        self.seed = seed
        self.duration_s = duration_s
        self.services = services
        self.rng = random.Random(f"{seed}/{transport_name}")
        self.say = log
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.sink = TimedSink().start()
        self.settings, self.store, self.transport = backend.open()
        self.workers: list[WorkerProc] = []
        self._worker_seq = 0
        self.gateway: subprocess.Popen[bytes] | None = None
        self.gateway_port = free_port()
        self.gateway_log = tmp_path / "gateway.log"
        self.tokens_file = tmp_path / "tokens.yaml"
        write_tokens_file(self.tokens_file, {TENANT: [hash_token(TOKEN)]})
        self.faults: Counter[str] = Counter()
        self.fault_log: list[dict[str, Any]] = []
        self.depth_samples = 0
        self.depth_max = 0
        self.depth_over: list[tuple[float, int]] = []
        self.depth_unavailable = 0
        self.depth_errors: Counter[str] = Counter()
        #: The store's unfinished count (what admission compares on every transport): sampled
        #: beside the transport's depth, which on Kafka is the lag, only a signal.
        self.unfinished_samples = 0
        self.unfinished_max = 0
        self.unfinished_over: list[tuple[float, int]] = []
        self.clients: list[ClientStats] = [ClientStats() for _ in range(CLIENTS)]
        self.crashes: list[str] = []
        self.refused_starts = 0
        #: When the next replacement of a worker that exited 3 at start may start (monotonic), and
        #: how many wait: a kubelet's back-off, so an outage does not become a loop of imports.
        self._restart_at = 0.0
        self._restarts_due = 0
        self.stop_load = threading.Event()
        self.stop_sampling = threading.Event()
        self.lock = threading.Lock()
        self.timers: list[threading.Timer] = []
        self.recovered_in_s: float | None = None
        self.final_depth: int | str = "never measured"
        #: Seconds from SIGTERM to exit, per worker stopped at the end.
        self.stop_seconds: dict[str, float] = {}
        self.report: dict[str, Any] = {}
        self.quorum = QuorumWatch(services.kafka) if transport_name == REPLICATED else None

    # --- processes ---------------------------------------------------------------------------

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def start_worker(self) -> WorkerProc:
        self._worker_seq += 1
        worker_id = f"chaos-w{self._worker_seq}"
        port = free_port()
        log = self.tmp / f"{worker_id}.log"
        proc = start_worker(
            self.backend,
            sink_url=self.sink.url,
            concurrency=CONCURRENCY,
            log=log,
            extra={"AGENT_DISPATCH_WORKER_ID": worker_id, "AGENT_DISPATCH_METRICS_PORT": str(port)},
        )
        worker = WorkerProc(worker_id, proc, port, log)
        with self.lock:
            self.workers.append(worker)
        return worker

    def start_gateway(self) -> None:
        env = {
            **BASE_ENV,
            **self.backend.env,
            "AGENT_DISPATCH_TOKENS_FILE": str(self.tokens_file),
            "AGENT_DISPATCH_LOG_FORMAT": "text",
            "PYTHONPATH": str(ROOT),
        }
        with self.gateway_log.open("ab") as out:
            self.gateway = subprocess.Popen(
                [sys.executable, "-m", "agent_dispatch.cli", "gateway", "--port", str(self.gateway_port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
            )
        deadline = time.monotonic() + 60
        while not port_open(self.gateway_port):
            if self.gateway.poll() is not None:
                raise AssertionError(
                    f"gateway exited {self.gateway.returncode}:\n{self._tail(self.gateway_log)}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"gateway did not listen within 60s:\n{self._tail(self.gateway_log)}")
            time.sleep(0.1)

    def stop_gateway(self, *, hard: bool) -> None:
        proc, self.gateway = self.gateway, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            self.crashes.append("gateway did not stop within 30s of SIGTERM")
        if not hard and proc.returncode != 0:
            self.crashes.append(f"gateway exited {proc.returncode} after SIGTERM")

    @staticmethod
    def _tail(path: Path, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def live_workers(self) -> list[WorkerProc]:
        with self.lock:
            return [w for w in self.workers if not w.killed]

    # --- load ----------------------------------------------------------------------------------

    def _post(self, body: dict[str, Any], key: str) -> tuple[int | None, dict[str, Any]]:
        # Longer than the gateway's wait for a Kafka delivery (30 s, then 503), so that refusal is
        # seen rather than a client timeout.
        answer = post_turn(self.gateway_port, TOKEN, body, key, timeout_s=45)
        return answer.status, answer.handle

    def _client(self, index: int) -> None:
        rng = random.Random(f"{self.seed}/{self.name}/client{index}")
        stats = self.clients[index]
        n = 0
        while not self.stop_load.is_set():
            n += 1
            key = f"c{index}-{n}"
            stats.submitted_keys.append(key)
            body = {
                "kind": "chaos",
                "session_id": f"s{index}-{rng.randrange(SESSIONS_PER_CLIENT)}",
                "payload": {"sleep_s": round(rng.uniform(0, 0.25), 3)},
            }
            backoff = 0.05
            while not self.stop_load.is_set():
                sent = time.time()
                status, handle = self._post(body, key)
                stats.statuses[str(status)] += 1
                if status in {202, 503}:
                    stats.answers.append((key, sent, time.time(), status, handle.get("created") is True))
                if status == 202:
                    stats.accepted[key] = deterministic_id(TENANT, key)
                    # A replayed key answers with the item as it is: note what the client was told.
                    stats.answered_states[f"{handle.get('state')}/created={handle.get('created')}"] += 1
                    break
                if status is not None and status not in {429, 503}:
                    stats.unexpected.append(f"{key}: HTTP {status}")
                    break
                # 429 queue full, 503 backend unavailable, or no answer: the same key again later.
                self.stop_load.wait(backoff)
                backoff = min(backoff * 2, 1.0)
            self.stop_load.wait(rng.uniform(0.0, 0.05))

    # --- sampling ------------------------------------------------------------------------------

    def _sampler(self) -> None:
        last_scrape = 0.0
        while not self.stop_sampling.wait(0.2):
            try:
                depth = self.transport.depth()
            except Exception as exc:
                self.depth_unavailable += 1
                self.depth_errors[f"{type(exc).__name__}: {exc}"[:160]] += 1
            else:
                self.depth_samples += 1
                self.depth_max = max(self.depth_max, depth)
                if depth > self.settings.max_depth:
                    self.depth_over.append((self.elapsed(), depth))
            if isinstance(self.store, CountsUnfinished):
                try:
                    unfinished = self.store.unfinished()
                except Exception:
                    pass  # the database is down: the depth probe above counted the outage
                else:
                    self.unfinished_samples += 1
                    self.unfinished_max = max(self.unfinished_max, unfinished)
                    if unfinished > self.settings.max_depth:
                        self.unfinished_over.append((self.elapsed(), unfinished))
            if time.monotonic() - last_scrape >= 1.0:
                last_scrape = time.monotonic()
                for worker in self.live_workers():
                    if worker.stopped:
                        continue
                    with contextlib.suppress(Exception):
                        worker.last_scrape = scrape(worker.metrics_port, timeout=1.0).turns
                        worker.served = True
            for worker in self.live_workers():
                if worker.proc.poll() is not None and not worker.killed:
                    with self.lock:
                        worker.killed = True
                    if worker.proc.returncode == 3 and not worker.served and self.refused_starts < 100:
                        # By design a worker whose transport is unreachable at start exits 3 at once
                        # (a replacement started while a server restarts); like a kubelet, start
                        # another. Exit 3 after start-up, or a refusal loop, stays a failure.
                        self.refused_starts += 1
                        self._restarts_due += 1
                        continue
                    self.crashes.append(
                        f"{worker.worker_id} exited {worker.proc.returncode} unprompted:\n"
                        f"{self._tail(worker.log)}"
                    )
            if self._restarts_due and time.monotonic() >= self._restart_at:
                self._restarts_due -= 1
                self._restart_at = time.monotonic() + 2.0
                self.start_worker()
            gateway = self.gateway
            if gateway is not None and gateway.poll() is not None and gateway is self.gateway:
                self.crashes.append(f"gateway exited {gateway.returncode} unprompted")
                self.gateway = None

    # --- faults --------------------------------------------------------------------------------

    def plan(self) -> list[tuple[float, str]]:
        """(offset in seconds, fault) pairs: every fault type once (shuffled), then random ones."""
        from tests.chaos.faults import plan

        return plan(self)

    def record(self, kind: str, **detail: Any) -> None:
        self.faults[kind] += 1
        entry = {"t": self.elapsed(), "fault": kind, **detail}
        self.fault_log.append(entry)
        self.say(f"[chaos {self.name}] {json.dumps(entry)}")

    # --- the run -------------------------------------------------------------------------------

    def run(self) -> None:
        plan = self.plan()
        self.say(f"[chaos {self.name}] seed={self.seed} duration={self.duration_s}s plan={plan}")
        self.start_gateway()
        for _ in range(WORKERS):
            self.start_worker()
        sampler = threading.Thread(target=self._sampler, name="chaos-sampler", daemon=True)
        sampler.start()
        clients = [
            threading.Thread(target=self._client, args=(i,), name=f"chaos-client-{i}", daemon=True)
            for i in range(CLIENTS)
        ]
        for thread in clients:
            thread.start()
        from tests.chaos.faults import run_plan

        faults = threading.Thread(target=run_plan, args=(self, plan), name="chaos-faults", daemon=True)
        faults.start()
        faults.join(timeout=self.duration_s + 600)
        # Whatever the plan's last step took, the load runs for the whole duration.
        remaining = self.t0 + self.duration_s - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        self.stop_load.set()
        for thread in clients:
            thread.join(timeout=30)
        self._heal()
        faults_over = time.monotonic()
        self.say(f"[chaos {self.name}] faults over at {self.elapsed()}s; waiting for every turn to settle")
        try:
            self._settle(deadline=faults_over + RTO_S)
            self.recovered_in_s = round(time.monotonic() - faults_over, 1)
            # Every delivery acknowledged, while the workers still run (on Kafka, duplicates the
            # recovery sweep re-drove are still to be consumed and skipped).
            self.final_depth = self._final_depth()
        finally:
            self.stop_sampling.set()
            sampler.join(timeout=10)

    def _heal(self) -> None:
        """Faults stop: resume paused workers, every server up, the gateway and WORKERS workers live."""
        for timer in self.timers:
            timer.join(timeout=self.settings.claim_ttl_s + 5)  # a pause in progress runs its course
        for worker in self.live_workers():
            if worker.stopped:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGCONT)
                worker.stopped = False
        if self.services.postgres is not None and not self.services.postgres.running:
            self.services.postgres.start()
        if self.services.kafka is not None and not self.services.kafka.running:
            self.services.kafka.start()
        if self.gateway is None or self.gateway.poll() is not None:
            self.start_gateway()
        self._restarts_due = 0  # the servers are up: top up now, without the back-off
        while len(self.live_workers()) < WORKERS:
            self.start_worker()
        # A replacement started a moment ago may still be importing: the faults are over when
        # every worker serves (its signal handlers are in place from then on).
        for worker in self.live_workers():
            self._wait_ready(worker)

    def _wait_ready(self, worker: WorkerProc, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if worker.proc.poll() is not None:
                return  # the sampler reports it as a crash
            with contextlib.suppress(OSError):
                url = f"http://127.0.0.1:{worker.metrics_port}/readyz"
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        worker.served = True
                        return
            time.sleep(0.2)
        self.crashes.append(f"{worker.worker_id} was not ready {timeout:.0f}s after it started")

    def all_items(self) -> list[WorkItem]:
        items: list[WorkItem] = []
        after: str | None = None
        while True:
            page = _retry(lambda after=after: self.store.list_items(tenant=TENANT, limit=500, after=after))
            items.extend(page)
            if len(page) < 500:
                return items
            after = page[-1].id

    def _settle(self, deadline: float) -> None:
        pending: list[WorkItem] = []
        while time.monotonic() < deadline:
            try:
                pending = [item for item in self.all_items() if item.state not in TERMINAL]
            except Exception:
                pending = []
                time.sleep(1)
                continue
            if not pending:
                return
            time.sleep(1)
        sample = [(i.id, i.state.value, i.lease_owner) for i in pending[:5]]
        raise AssertionError(
            f"{self.name}: {len(pending)} turns not terminal {RTO_S}s after the faults stopped, e.g. {sample}"
        )

    def finish(self) -> None:
        """Scrape every live worker's metrics, then stop the workers and the gateway."""
        for worker in self.live_workers():
            try:
                final = scrape(worker.metrics_port, timeout=10)
            except Exception as exc:
                self.crashes.append(f"{worker.worker_id}: /metrics did not answer at the end: {exc!r}")
                continue
            worker.last_scrape = final.turns
            if final.in_flight != 0:
                self.crashes.append(f"{worker.worker_id} still has {final.in_flight} turns in flight")
            if time.time() - final.heartbeat > 10:
                self.crashes.append(
                    f"{worker.worker_id}: claim loop stalled (last heartbeat {time.time() - final.heartbeat:.0f}s ago)"
                )
        stopping = self.live_workers()
        signalled = time.monotonic()
        for worker in stopping:
            worker.proc.send_signal(signal.SIGTERM)
        # Each worker must exit within its shutdown grace plus the transport's bounded close.
        deadline = signalled + self.settings.shutdown_grace_s + 20
        while stopping and time.monotonic() < deadline:
            for worker in [w for w in stopping if w.proc.poll() is not None]:
                stopping.remove(worker)
                self.stop_seconds[worker.worker_id] = round(time.monotonic() - signalled, 1)
                if worker.proc.returncode != 0:
                    self.crashes.append(
                        f"{worker.worker_id} exited {worker.proc.returncode} after SIGTERM:\n"
                        f"{self._tail(worker.log)}"
                    )
            time.sleep(0.05)
        for worker in stopping:
            dump = _py_spy_dump(worker.proc.pid)
            worker.proc.kill()
            worker.proc.wait(timeout=10)
            self.crashes.append(
                f"{worker.worker_id} did not stop within {deadline - signalled:.0f}s of SIGTERM:\n"
                f"{self._tail(worker.log)}\n{dump}"
            )
        self.stop_gateway(hard=False)

    def close(self) -> None:
        for timer in self.timers:
            timer.cancel()
        for worker in self.workers:
            if worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGCONT)
                worker.proc.kill()
                with contextlib.suppress(Exception):
                    worker.proc.wait(timeout=10)
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.kill()
        self.sink.stop()
        with contextlib.suppress(Exception):
            self.transport.close()
        with contextlib.suppress(Exception):
            self.store.close()

    # --- the invariants ------------------------------------------------------------------------

    def verify(self) -> dict[str, Any]:
        """Check every invariant; returns the report (``violations`` lists what failed)."""
        from tests.chaos.checks import verify

        self.report = verify(self)
        return self.report

    def _final_depth(self) -> int | str:
        deadline = time.monotonic() + 90
        depth: int | str = "never measured"
        while time.monotonic() < deadline:
            try:
                depth = self.transport.depth()
            except Exception as exc:
                depth = f"unknown ({type(exc).__name__}: {exc})"
            if depth == 0:
                return 0
            time.sleep(0.5)
        if self.name.startswith("kafka"):
            from tests.chaos.kafka_support import kafka_diagnosis

            depth = f"{depth}; {kafka_diagnosis(self)}"
        # Where every worker's threads are (a claim loop stuck in a call keeps its deliveries).
        dumps = [
            f"--- {w.worker_id}\n{_py_spy_dump(w.proc.pid)}" for w in self.live_workers() if not w.stopped
        ]
        return f"{depth}\n" + "\n".join(dumps)


def write_report(path: Path | None, report: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(report) + "\n")


def env_for_chaos() -> dict[str, str]:
    """Backend overrides: a small depth bound and attempts enough to survive repeated kills."""
    return {
        "AGENT_DISPATCH_MAX_DEPTH": str(MAX_DEPTH),
        "AGENT_DISPATCH_MAX_ATTEMPTS": "20",
        "AGENT_DISPATCH_LOG_LEVEL": "WARNING",
    }


__all__ = ["ChaosRun", "Services", "env_for_chaos", "write_report"]
