"""Concurrent requests served in shared batches: group commit for ``POST /api/turns``, one read
for many ``GET /api/graph/jobs/{id}``.

On the database queues every admission ends on the queue's one depth row (the O(1) bound), so
single-turn transactions run one after the other however many clients there are; batches are
how the store and the queue go fast (one transaction, one pipeline, one depth update). Reads pay
per request what a batch pays once: the hand-off to an I/O thread, a pooled connection, a round
trip. This turns concurrent requests into such batches without delaying a lone one: the first
request is sent at once; requests that arrive while a batch is running (:data:`IN_FLIGHT`) wait
for the next batch, which then holds all of them (up to :data:`MAX_SIZE`).

Every request keeps its own outcome (the batch function gives one per request, and one refusal
hides no other), so a client sees exactly what it would have seen alone. Written here because the
kept batchers batch differently: aiodataloader (keyed reads) sends what was asked within one
event-loop tick, which under a steady stream of requests is a batch of one or two, where this
sends whatever arrived while the previous batches were in flight.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Generic, TypeAlias, TypeVar

from agent_dispatch.errors import DispatchError
from agent_dispatch.models import SubmitRequest, SubmitResult

RequestT = TypeVar("RequestT")
OutcomeT = TypeVar("OutcomeT")

#: A submission's outcome: its result, or its own refusal.
Outcome: TypeAlias = SubmitResult | DispatchError

#: Batches running at once; more waiting requests form the next batch instead. One: admissions
#: take the queue's depth row one after the other anyway, so a second batch in flight only waited
#: on its lock and split the waiting requests into smaller transactions. Measured with 32 clients
#: on PostgreSQL (2026-12-06), against two in flight: single submissions 956 -> 1,215 turns/s
#: (means of 3 runs), status reads 2,324 -> 2,673 requests/s (means of 2).
IN_FLIGHT: Final = 1
#: The most requests in one batch (the batch endpoint's own turns per request are of this order).
MAX_SIZE: Final = 200


class Coalescer(Generic[RequestT, OutcomeT]):
    """Runs requests in batches through ``run_many`` (one outcome per request, in order); see the
    module docstring. One per event loop."""

    def __init__(
        self,
        run_many: Callable[[Sequence[RequestT]], Awaitable[Sequence[OutcomeT]]],
        *,
        observe_size: Callable[[int], None] | None = None,
    ) -> None:
        self._run_many = run_many
        self._observe_size = observe_size
        self._waiting: deque[tuple[RequestT, asyncio.Future[OutcomeT]]] = deque()
        self._in_flight = 0

    async def run(self, request: RequestT) -> OutcomeT:
        """This request's outcome; an exception of the whole batch (a bug, or a failure every
        request shares) is raised to every request of its batch."""
        future: asyncio.Future[OutcomeT] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if self._in_flight < IN_FLIGHT:
            self._in_flight += 1
            # A task of its own: a client that disconnects cancels its handler, never a batch that
            # carries other clients' requests.
            asyncio.get_running_loop().create_task(self._drain())
        return await asyncio.shield(future)

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch = [self._waiting.popleft() for _ in range(min(MAX_SIZE, len(self._waiting)))]
                if self._observe_size is not None:
                    self._observe_size(len(batch))
                try:
                    outcomes = await self._run_many([request for request, _ in batch])
                except asyncio.CancelledError:  # the loop is shutting down
                    for _, future in batch:
                        future.cancel()
                    raise
                except Exception as exc:  # every waiter of the batch gets it
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), outcome in zip(batch, outcomes, strict=True):
                    if not future.done():
                        future.set_result(outcome)
        finally:
            self._in_flight -= 1


#: The gateway's group commit of single-turn submissions.
SubmitCoalescer: TypeAlias = Coalescer[SubmitRequest, Outcome]
