"""Depth and throughput over the last minutes, for the web UI's overview.

Every ``interval_s`` one sample: the transport's depth (an O(1) counter or the broker's lag) and
the outcome records appended since the previous sample (read from the store's append order, a
primary-key range, never the whole table). Rates come from those records, so they cover every
worker, not only this process's. Each sample also folds the store's per-tenant counters.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from agent_dispatch.models import Outcome
from agent_dispatch.store import Inspectable

#: Five minutes of samples at the default interval.
HISTORY: Final = 150
#: At most this many records are read per sample; a busier store is read over several samples.
READ_LIMIT: Final = 20000
COUNTED: Final = ("admitted", "succeeded", "failed", "dead_lettered", "cancelled")


@dataclass(frozen=True)
class Sample:
    at: float
    depth: int | None
    counts: dict[str, int]


@dataclass
class Sampler:
    store: Inspectable
    depth: Callable[[], int]
    interval_s: float = 2.0
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=HISTORY))
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTED, 0))
    started: float = field(default_factory=time.time)
    _seq: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sample(self) -> Sample:
        """Take one sample now (blocking: run it on the gateway's thread pool)."""
        with self._lock:
            if self._seq is None:
                newest = self.store.events_after(-1)
                self._seq = newest[0].seq if newest else 0
            counts = dict.fromkeys(COUNTED, 0)
            events = self.store.events_after(self._seq, limit=READ_LIMIT)
            for event in events:
                self._count(event.record.event, event.record.outcome, counts)
            if events:
                self._seq = events[-1].seq
            # Compacts the per-tenant counters' deltas (PostgreSQL), so a page reads one row per tenant.
            self.store.fold_tenant_counts()
            try:
                depth: int | None = self.depth()
            except Exception:
                depth = None  # unknown is shown as unknown, never as an empty queue
            sample = Sample(time.time(), depth, counts)
            self.samples.append(sample)
            for name, value in counts.items():
                self.totals[name] += value
            return sample

    @staticmethod
    def _count(event: str, outcome: str | None, counts: dict[str, int]) -> None:
        if event == "submit":
            counts["admitted"] += 1
        elif event == "commit" and outcome == Outcome.SUCCEEDED.value:
            counts["succeeded"] += 1
        elif event in {"commit", "retry"} and outcome == Outcome.FAILED.value:
            counts["failed"] += 1
        elif event == "dead_letter":
            counts["dead_lettered"] += 1
        elif event in {"cancel", "expire"}:
            counts["cancelled"] += 1

    def history(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def rates_per_min(self, window_s: float = 60.0) -> dict[str, float]:
        """Events per minute over the last ``window_s`` of samples."""
        samples = self.history()
        if not samples:
            return dict.fromkeys(COUNTED, 0.0)
        cutoff = samples[-1].at - window_s
        recent = [s for s in samples if s.at > cutoff]
        # Each sample counts what happened since the one before it: about one interval each.
        span = len(recent) * self.interval_s
        return {name: round(sum(s.counts[name] for s in recent) * 60.0 / span, 1) for name in COUNTED}
