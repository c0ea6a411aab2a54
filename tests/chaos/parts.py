"""The chaos harness's parts: the timed fencing sink, worker and client records, a metrics
scrape, and helpers (stack dumps, retried reads) that :mod:`tests.chaos.harness` and
:mod:`tests.chaos.checks` share."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.sink import FencingSink

_TURNS = re.compile(r'^agent_dispatch_turns_total\{outcome="(\w+)"\} ([0-9.e+]+)$', re.M)
_GAUGE = r"^{name} ([0-9.e+-]+)$"


class TimedSink(FencingSink):
    """The fencing sink, also noting when each effect was accepted (wall clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.accepted_at: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def offer(self, job_id: str, token: int) -> bool:
        ok = super().offer(job_id, token)
        if ok:
            with self.lock:
                self.accepted_at[job_id].append((token, time.time()))
        return ok


@dataclass
class WorkerProc:
    worker_id: str
    proc: subprocess.Popen[bytes]
    metrics_port: int
    log: Path
    killed: bool = False
    stopped: bool = False
    served: bool = False  # answered /metrics or /readyz at least once (it got past start-up)
    last_scrape: dict[str, float] = field(default_factory=dict)


@dataclass
class Scrape:
    turns: dict[str, float]
    heartbeat: float
    in_flight: float


def scrape(port: int, timeout: float = 3.0) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    turns = {outcome: float(value) for outcome, value in _TURNS.findall(text)}

    def gauge(name: str) -> float:
        found = re.search(_GAUGE.format(name=name), text, re.M)
        return float(found.group(1)) if found else float("nan")

    return Scrape(
        turns,
        gauge("agent_dispatch_worker_heartbeat_timestamp_seconds"),
        gauge("agent_dispatch_turns_in_flight"),
    )


@dataclass
class Services:
    """The servers a fault may restart (None when the transport has none)."""

    postgres: Any = None
    kafka: Any = None


@dataclass
class ClientStats:
    submitted_keys: list[str] = field(default_factory=list)
    accepted: dict[str, str] = field(default_factory=dict)  # key -> job id (202 seen)
    statuses: Counter[str] = field(default_factory=Counter)
    answered_states: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    #: (key, sent, answered, status, created) of every 202 and 503, wall clock: the replicated
    #: run's check that no fresh 202 was given while no quorum of replicas could hold the turn.
    answers: list[tuple[str, float, float, int, bool]] = field(default_factory=list)


def _py_spy_dump(pid: int) -> str:
    """The stacks of a process that does not stop (py-spy, when installed), for the failure message."""
    try:
        done = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(no stack dump: {exc!r})"
    return done.stdout[-6000:] or done.stderr[-2000:]


def _retry(fn: Callable[[], Any], attempts: int = 20) -> Any:
    """A read against a store that may have just been restarted (broken pooled connections)."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception:
            if attempt == attempts - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")
