"""The Kafka depth: the probed group lag plus what this process has in flight.

A signal (autoscaling, metrics, the availability probe of the enqueue path), not the admission
bound: the lag counts re-driven duplicates and acknowledged offsets the commit has not passed yet,
so it can stand far above the number of accepted, unfinished turns. The enqueue path bounds those
with the WorkItem store's count (``agent_dispatch.dispatch.Counted``). The lag still guards a
direct bounded ``KafkaTransport.admit`` (fail-closed: over-counting only ever refuses).

Depth is measured under a timeout. A failed or slow probe raises :class:`DepthUnavailable`; it is
never read as zero. The probe is cached for a fraction of a second so a probe costs the same at
depth 0 and at depth 100k, and turns admitted by this process since the probe began are added to
it, so concurrent admitters in one process cannot overshoot between probes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent_dispatch.errors import DepthUnavailable, QueueFull


@dataclass(frozen=True)
class _Probe:
    started: float
    #: Turns settled (see :class:`DepthBound`) before the probe began: the in-flight baseline.
    reported: int
    lag: int | None
    error: str | None = None


class DepthBound:
    """The books of the depth signal, and of the guard that keeps a bounded ``admit`` under ``max_depth``.

    ``measure()`` is the group lag (raising :class:`DepthUnavailable`); ``delivered()`` counts the
    producer's delivery reports. A turn is counted from its reservation until it is settled: by a
    delivery report, or locally (:meth:`settle_unsent`) when it never reaches the producer.
    """

    def __init__(
        self,
        max_depth: int,
        *,
        measure: Callable[[], int],
        delivered: Callable[[], int],
        cache_s: float,
    ) -> None:
        self.max_depth = max_depth
        self._measure = measure
        self._delivered = delivered
        self._cache_s = cache_s
        self._probe_lock = threading.Lock()
        self._probe: _Probe | None = None
        self._lock = threading.Lock()
        self._reserved = 0
        self._failed_locally = 0

    def reserve(self, count: int) -> None:
        """Check depth + count against the bound and count the turns in flight, or raise.

        The estimate is the probed lag plus every turn this process sent that had not been
        confirmed when the probe began: those may or may not be in the probed watermarks, so they
        are counted (over-counting only ever rejects, never over-admits).
        """
        probe = self._fresh_probe(time.monotonic())
        if probe.lag is None:
            raise DepthUnavailable(probe.error or "kafka depth probe failed")
        with self._lock:
            depth = probe.lag + max(0, self._reserved - probe.reported)
            if depth + count > self.max_depth:
                raise QueueFull(f"queue depth {depth} + {count} exceeds {self.max_depth}")
            self._reserved += count

    def count_unbounded(self, count: int) -> None:
        """Turns admitted past the bound (re-drives): counted in flight all the same."""
        with self._lock:
            self._reserved += count

    def settle_unsent(self, count: int) -> None:
        """Counted turns that will never be produced: settled like ones that never reached librdkafka."""
        if count > 0:
            with self._lock:
                self._failed_locally += count

    def depth(self) -> int:
        probe = self._fresh_probe(time.monotonic())
        if probe.lag is None:
            raise DepthUnavailable(probe.error or "kafka depth probe failed")
        with self._lock:
            return probe.lag + max(0, self._reserved - probe.reported)

    def _settled(self) -> int:
        return self._delivered() + self._failed_locally

    def _fresh_probe(self, arrival: float) -> _Probe:
        """A lag probe that began no more than ``cache_s`` before ``arrival``.

        Single flight: callers that arrive while a probe runs wait for it and share its answer
        (a failure too: during an outage, N callers wait one timeout, not N timeouts in a row).
        """
        probe = self._probe
        if probe is not None and arrival - probe.started <= self._cache_s:
            return probe
        with self._probe_lock:
            probe = self._probe
            if probe is not None and arrival - probe.started <= self._cache_s:
                return probe
            started = time.monotonic()
            reported = self._settled()
            try:
                probe = _Probe(started, reported, self._measure())
            except DepthUnavailable as exc:
                probe = _Probe(started, reported, None, str(exc))
            self._probe = probe
            return probe
