"""Commits that no claim would send soon: acknowledgements of idle consumers, orphaned consumers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agent_dispatch.transports.kafka._consumer import ThreadConsumer

log = logging.getLogger(__name__)


class Committer:
    """Background thread: flushes coalesced commits of idle consumers, closes orphaned ones.

    A consumer whose owner thread is inside a call is skipped (non-blocking lock): that call
    commits by itself. A consumer whose owner thread has exited is closed, so its partitions move
    to live consumers now rather than after the visibility timeout.
    """

    def __init__(
        self,
        consumers: Callable[[], list[ThreadConsumer]],
        forget: Callable[[ThreadConsumer], None],
        *,
        interval_s: float,
        close_timeout_s: float,
    ) -> None:
        """``consumers()`` lists the live consumers; ``forget(tc)`` drops one whose thread exited."""
        self._consumers = consumers
        self._forget = forget
        self._interval_s = max(0.005, interval_s)
        self._close_timeout_s = close_timeout_s
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kafka-committer", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stopping:
                return
            time.sleep(self._interval_s)  # let the acknowledgements of a burst pile into one commit
            retry = False
            for tc in self._consumers():
                if self._stopping:
                    return  # the pool's close takes the rest, in parallel
                try:
                    if not tc.thread.is_alive():
                        self._forget(tc)
                        if not tc.close(self._close_timeout_s):
                            log.warning("kafka consumer of an exited thread did not close in time")
                    elif tc.dirty:
                        if not tc.lock.acquire(blocking=False):
                            retry = True  # the owner is in a call; look again after the interval
                            continue
                        try:
                            if not tc.closed:
                                tc.commit(force=True)
                        finally:
                            tc.lock.release()
                except Exception:  # keep flushing the others
                    log.exception("kafka background commit failed")
            if retry:
                self._wake.set()

    def stop(self, timeout_s: float) -> None:
        """Stop after the consumer in hand, waiting up to ``timeout_s`` for it: a close in progress
        has to finish before the process exits, or the group never hears that it left."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)
