"""The chaos suite's faults: a seeded plan, and how each fault is injected into a :class:`ChaosRun`.

The replicated-Kafka faults are in :mod:`tests.chaos.kafka_support`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import traceback

from tests.chaos.harness import FAULTS_BY_TRANSPORT, ChaosRun, WorkerProc
from tests.chaos.kafka_support import REPLICATED_FAULTS, inject_replicated


def plan(run: ChaosRun) -> list[tuple[float, str]]:
    """(offset in seconds, fault) pairs: every fault type once (shuffled), then random ones."""
    kinds = FAULTS_BY_TRANSPORT[run.name]
    first = list(kinds)
    run.rng.shuffle(first)
    step = min(run.duration_s / (len(first) + 1), 8.0)
    at = 0.0
    steps = []
    for kind in first:
        at += run.rng.uniform(0.5, 1.0) * step
        steps.append((round(at, 2), kind))
    # Soak: more of the same, weighted towards the cheap ones, until the duration is over.
    weights = {"worker_kill": 4, "worker_stop": 3, "gateway_restart": 2}
    while True:
        at += run.rng.uniform(2.0, 8.0)
        if at >= run.duration_s:
            break
        kind = run.rng.choices(kinds, [weights.get(k, 1) for k in kinds])[0]
        steps.append((round(at, 2), kind))
    return steps


def inject(run: ChaosRun, kind: str) -> None:
    ttl = run.settings.claim_ttl_s
    if kind == "worker_kill":
        candidates = run.live_workers()
        victim = run.rng.choice(candidates)
        with run.lock:
            victim.killed = True
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        replacement = run.start_worker()
        run.record(kind, worker=victim.worker_id, replacement=replacement.worker_id)
    elif kind == "worker_stop":
        candidates = [w for w in run.live_workers() if not w.stopped]
        if not candidates:
            return
        victim = run.rng.choice(candidates)
        pause = round(ttl + run.rng.uniform(1.0, 3.0), 2)
        victim.stopped = True
        victim.proc.send_signal(signal.SIGSTOP)

        def resume(worker: WorkerProc = victim) -> None:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGCONT)
            worker.stopped = False

        timer = threading.Timer(pause, resume)
        timer.daemon = True
        timer.start()
        run.timers.append(timer)
        run.record(kind, worker=victim.worker_id, pause_s=pause)
    elif kind == "gateway_restart":
        hard = run.rng.random() < 0.5
        run.stop_gateway(hard=hard)
        down = round(run.rng.uniform(0.2, 2.0), 2)
        time.sleep(down)
        run.start_gateway()
        run.record(kind, signal="SIGKILL" if hard else "SIGTERM", down_s=down)
    elif kind == "postgres_restart":
        immediate = run.rng.random() < 0.5
        started = time.monotonic()
        run.services.postgres.restart(immediate=immediate)
        run.record(kind, immediate=immediate, took_s=round(time.monotonic() - started, 2))
    elif kind == "kafka_restart":
        immediate = run.rng.random() < 0.5
        started = time.monotonic()
        run.services.kafka.restart(immediate=immediate)
        run.record(kind, immediate=immediate, took_s=round(time.monotonic() - started, 2))
    elif kind in REPLICATED_FAULTS:
        inject_replicated(run, kind)
    else:
        raise AssertionError(f"unknown fault {kind}")


def run_plan(run: ChaosRun, plan: list[tuple[float, str]]) -> None:
    """Inject each fault at its offset (at once when behind), until the load stops.

    Every type's first injection always happens; after those, a fault whose turn comes once the
    duration is over is dropped. Broker faults block while the brokers come back (10-60 s on a
    busy machine), so without this a soak's plan, drawn for ``duration_s``, would run for far
    longer, and a short run would add faults past its 20 s.
    """
    begin = time.monotonic()
    first = len(FAULTS_BY_TRANSPORT[run.name])
    for index, (offset, kind) in enumerate(plan):
        if index >= first and time.monotonic() - begin >= run.duration_s:
            run.say(f"[chaos {run.name}] {len(plan) - index} planned faults dropped: the duration is over")
            return
        wait = begin + offset - time.monotonic()
        if wait > 0 and run.stop_load.wait(wait):
            return
        try:
            inject(run, kind)
        except Exception:
            run.crashes.append(f"injecting {kind} failed:\n{traceback.format_exc()}")
