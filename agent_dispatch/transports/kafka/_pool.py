"""The worker threads' consumers: one per thread, created by its first claim, closed together."""

from __future__ import annotations

import logging
import threading
import time

from agent_dispatch.errors import BackendUnavailable, Fenced
from agent_dispatch.transport import Delivery, Receipt
from agent_dispatch.transports.kafka._bookkeeping import Token
from agent_dispatch.transports.kafka._committer import Committer
from agent_dispatch.transports.kafka._consumer import ConsumerSpec, ThreadConsumer

log = logging.getLogger(__name__)


class ConsumerPool:
    """Routes claim, ack and release to the calling thread's consumer.

    A receipt is honoured only by the consumer that issued it, on the thread that owns it; any
    other thread gets :class:`Fenced`.
    """

    def __init__(self, spec: ConsumerSpec) -> None:
        self._spec = spec
        self._lock = threading.Lock()
        self._closed = False
        self._local = threading.local()
        self._consumers: dict[str, ThreadConsumer] = {}
        self._committer: Committer | None = None

    def _for_thread(self) -> ThreadConsumer:
        tc: ThreadConsumer | None = getattr(self._local, "consumer", None)
        if tc is None:
            with self._lock:
                if self._closed:
                    raise BackendUnavailable("kafka transport is closed")
                tc = ThreadConsumer(self._spec, on_dirty=self._commit_soon)
                self._consumers[tc.uid] = tc
                if self._committer is None:
                    self._committer = Committer(
                        self._list,
                        self._forget,
                        interval_s=self._spec.tuning.commit_interval_s,
                        close_timeout_s=self._spec.tuning.close_timeout_s,
                    )
            self._local.consumer = tc
        return tc

    def _list(self) -> list[ThreadConsumer]:
        with self._lock:
            return list(self._consumers.values())

    def _forget(self, tc: ThreadConsumer) -> None:
        with self._lock:
            self._consumers.pop(tc.uid, None)

    def _commit_soon(self) -> None:
        committer = self._committer
        if committer is not None:
            committer.kick()

    def claim(self, owner: str, *, max_items: int, wait_s: float) -> list[Delivery]:
        tc = self._for_thread()
        with tc.lock:
            if tc.closed:
                raise BackendUnavailable("kafka transport is closed")
            return tc.claim(owner, max_items, wait_s)

    def _own(self, receipt: Receipt) -> tuple[ThreadConsumer, Token]:
        token = Token.decode(receipt.token)
        tc: ThreadConsumer | None = getattr(self._local, "consumer", None)
        if tc is None or tc.uid != token.consumer:
            raise Fenced("the receipt belongs to another worker thread's consumer")
        return tc, token

    def ack(self, receipt: Receipt) -> None:
        tc, token = self._own(receipt)
        with tc.lock:
            if tc.closed:
                raise Fenced("the consumer that issued this receipt is closed")
            tc.ack(token, receipt.owner)

    def release(self, receipt: Receipt, *, delay_s: float) -> None:
        tc, token = self._own(receipt)
        with tc.lock:
            if tc.closed:
                raise Fenced("the consumer that issued this receipt is closed")
            tc.release(token, receipt.owner, delay_s)

    def close_mine(self) -> None:
        """Close the calling thread's consumer (a worker thread that exits calls this)."""
        tc: ThreadConsumer | None = getattr(self._local, "consumer", None)
        if tc is None:
            return
        self._local.consumer = None
        self._forget(tc)
        tc.close(self._spec.tuning.close_timeout_s)

    def close(self, timeout_s: float) -> None:
        """Commit and close every consumer in parallel, each abandoned after ``timeout_s``.

        Refuses new consumers from the start. The committer may be closing an exited thread's
        consumer (no longer in the list): that close is waited for too, within the same deadline.
        A worker exits right after this returns, and a close cut short by the exit sends no
        LeaveGroup: the group keeps that member until its session timeout (45 s), and every
        rebalance waits for it meanwhile.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        with self._lock:
            self._closed = True
            consumers = list(self._consumers.values())
            self._consumers.clear()
        closers = [threading.Thread(target=_close_within, args=(tc, left()), daemon=True) for tc in consumers]
        for closer in closers:
            closer.start()
        if self._committer is not None:
            self._committer.stop(timeout_s=left())
        for closer in closers:
            closer.join(left())


def _close_within(tc: ThreadConsumer, timeout_s: float) -> None:
    if not tc.close(timeout_s):
        log.warning(
            "kafka consumer did not close in time; the group removes it after its session timeout",
            extra={"timeout_s": round(timeout_s, 1)},
        )
