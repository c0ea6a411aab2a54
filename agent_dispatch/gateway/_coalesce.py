"""Group commit for single-turn submissions: concurrent ``POST /api/turns`` share a transaction.

On the database queues every admission ends on the queue's one depth row (the O(1) bound), so
single-turn transactions run one after the other however many clients there are; batches are
how the store and the queue go fast (one transaction, one pipeline, one depth update). This
turns concurrent single submissions into such batches without delaying a lone request: the first
request is sent at once; requests that arrive while :data:`IN_FLIGHT` batches are being admitted
wait for the next batch, which then holds all of them (up to :data:`MAX_SIZE`).

Every request keeps its own outcome (``Admission.enqueue_many`` gives one per request, and one
refusal hides no other), so a client sees exactly what it would have seen alone: its job, its
replay, or its own refusal. asyncio has no such batcher and the libraries that offer one (e.g.
aiodataloader) are for reads keyed by id, hence this small one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeAlias

from agent_dispatch.errors import DispatchError
from agent_dispatch.models import SubmitRequest, SubmitResult

Outcome: TypeAlias = SubmitResult | DispatchError
AdmitMany: TypeAlias = Callable[[Sequence[SubmitRequest]], Awaitable[Sequence[Outcome]]]

#: Batches being admitted at once; more waiting requests form the next batch instead. Two keep the
#: database busy while one batch's answers travel back, without competing for the depth row.
IN_FLIGHT: Final = 2
#: The most requests in one batch (the batch endpoint's own turns per request are of this order).
MAX_SIZE: Final = 200


class SubmitCoalescer:
    """Admits single submissions in batches; see the module docstring. One per event loop."""

    def __init__(self, admit_many: AdmitMany, *, observe_size: Callable[[int], None] | None = None) -> None:
        self._admit_many = admit_many
        self._observe_size = observe_size
        self._waiting: deque[tuple[SubmitRequest, asyncio.Future[Outcome]]] = deque()
        self._in_flight = 0

    async def submit(self, request: SubmitRequest) -> Outcome:
        """This request's outcome; an exception that is not a refusal (a bug) is raised to every
        request of its batch."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if self._in_flight < IN_FLIGHT:
            self._in_flight += 1
            # A task of its own: a client that disconnects cancels its handler, never a batch that
            # carries other clients' turns.
            asyncio.get_running_loop().create_task(self._drain())
        return await asyncio.shield(future)

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch = [self._waiting.popleft() for _ in range(min(MAX_SIZE, len(self._waiting)))]
                if self._observe_size is not None:
                    self._observe_size(len(batch))
                try:
                    outcomes = await self._admit_many([request for request, _ in batch])
                except asyncio.CancelledError:  # the loop is shutting down
                    for _, future in batch:
                        future.cancel()
                    raise
                except Exception as exc:  # a bug, not a refusal: every waiter answers 500
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), outcome in zip(batch, outcomes, strict=True):
                    if not future.done():
                        future.set_result(outcome)
        finally:
            self._in_flight -= 1
