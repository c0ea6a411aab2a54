"""What a tenant can do with jobs, shared by the HTTP handlers and the direct CLI client.

Validation, payload bounds, admission, pagination and tenant scoping live here once; the
gateway's handlers only authenticate, read the body and write the answer, and the CLI's direct
client only opens a runtime. Every refusal is one :class:`ServiceError`, which carries both its
HTTP meaning (status, stable code, the field at fault) and its CLI exit code. The calls block
(database drivers, the Kafka flush barrier): the gateway runs them on its thread pool.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from pydantic import ValidationError
from pydantic_core import to_json

from agent_dispatch import jobs
from agent_dispatch.dispatch import Admission
from agent_dispatch.errors import (
    BackendUnavailable,
    DepthUnavailable,
    DispatchError,
    IdempotencyConflict,
    InvalidRequest,
    InvalidTransition,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    SchemaOutdated,
)
from agent_dispatch.gateway._models import (
    BODY_OVERHEAD,
    DEFAULT_PAGE,
    IDEMPOTENCY_KEY_PATTERN,
    MAX_PAGE,
    REF_PATTERN,
    BatchBody,
    BatchItemResult,
    BatchResult,
    BatchTurnBody,
    ErrorBody,
    FieldError,
    JobHandle,
    JobList,
    JobView,
    TurnBody,
)
from agent_dispatch.models import SubmitRequest, SubmitResult, WorkItem, WorkState
from agent_dispatch.runtime import EXIT_FAILURE, EXIT_UNAVAILABLE, EXIT_USAGE
from agent_dispatch.settings import Settings
from agent_dispatch.store import WorkItemStore, check_payload

#: What a client is told to wait after 429/503; the queue drains at worker speed, so retry soon.
RETRY_AFTER_S: Final = 1

#: HTTP status -> CLI exit code: the caller's mistake is usage (2), an outage is 3, a refusal 1.
EXIT_FOR_STATUS: Final = {
    400: EXIT_USAGE,
    401: EXIT_USAGE,
    413: EXIT_USAGE,
    422: EXIT_USAGE,
    503: EXIT_UNAVAILABLE,
}

_IDEMPOTENCY: Final = re.compile(IDEMPOTENCY_KEY_PATTERN)
_REF: Final = re.compile(REF_PATTERN)
_STATES: Final = {s.value: s for s in WorkState}


class ServiceError(Exception):
    """A refusal: HTTP status, a stable machine code, a human detail and the field at fault."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        *,
        field: str | None = None,
        headers: Mapping[str, str] | None = None,
        errors: Sequence[Mapping[str, str]] = (),
        exit_code: int | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.field = field
        self.headers = dict(headers or {})
        self.errors = list(errors)
        self._exit_code = exit_code

    @property
    def exit_code(self) -> int:
        """The CLI's exit code for this refusal."""
        if self._exit_code is not None:
            return self._exit_code
        return EXIT_FOR_STATUS.get(self.status, EXIT_FAILURE)

    def body(self) -> dict[str, Any]:
        model = ErrorBody(
            error=self.code,
            detail=self.detail,
            field=self.field,
            errors=[FieldError.model_validate(e) for e in self.errors] or None,
        )
        return model.model_dump(mode="json", exclude_none=True)


def not_found() -> ServiceError:
    # Another tenant's job and a job that never existed get the same answer: nothing leaks.
    return ServiceError(404, "not_found", "no such job")


def view_json(item: WorkItem) -> bytes:
    """The :class:`JobView` answer of ``item`` as JSON, serialised from the projection without
    building the model: the projection is made from a WorkItem the store already checked, and
    validating it again was a tenth of a status read's CPU. tests/gateway/test_answer_json.py
    holds it byte for byte equal to the model's own JSON."""
    return to_json(jobs.project(item))


def _loc(loc: Sequence[int | str]) -> str:
    return ".".join(str(part) for part in loc) or "body"


def validation_error(exc: ValidationError, prefix: str = "") -> ServiceError:
    """422 naming the first bad field (400 when the body is not JSON at all)."""
    details = exc.errors(include_url=False, include_input=False)
    if details and details[0]["type"] in {"json_invalid", "json_type"}:
        return ServiceError(400, "malformed_json", "the request body is not valid JSON", field="body")
    errors = [
        {"field": prefix + _loc(d["loc"]), "message": str(d["msg"]).removeprefix("Value error, ")}
        for d in details
    ]
    first = errors[0]
    return ServiceError(
        422, "invalid_field", f"{first['field']}: {first['message']}", field=first["field"], errors=errors
    )


def queue_full() -> ServiceError:
    """``QueueFull``'s answer: a submit, and the web UI's retry of a dead letter, at the bound."""
    return ServiceError(
        429,
        "queue_full",
        "the queue is at its depth bound; retry later",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def admission_error(exc: Exception) -> ServiceError | None:
    """The meaning of an error from the enqueue path or a store read; ``None`` for anything else."""
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(exc, QueueFull):
        return queue_full()
    if isinstance(exc, DepthUnavailable):
        # Fail closed: an unknown depth is never treated as an empty queue.
        return ServiceError(
            503, "depth_unavailable", "queue depth cannot be measured; retry later", headers=retry
        )
    if isinstance(exc, PayloadTooLarge):
        return ServiceError(413, "payload_too_large", str(exc), field="payload")
    if isinstance(exc, IdempotencyConflict):
        return ServiceError(
            409,
            "idempotency_conflict",
            "this Idempotency-Key was already used for a different request",
            field="Idempotency-Key",
        )
    if isinstance(exc, NotFound):
        return ServiceError(
            422, "invalid_field", "depends_on: a dependency does not exist", field="depends_on"
        )
    if isinstance(exc, InvalidRequest):
        return ServiceError(422, "invalid_request", str(exc))
    if isinstance(exc, InvalidTransition):
        return ServiceError(409, "invalid_transition", str(exc))
    return unavailable(exc)


def unavailable(exc: Exception) -> ServiceError | None:
    if not isinstance(exc, BackendUnavailable | SchemaOutdated):
        return None
    return ServiceError(
        503,
        "unavailable",
        "the WorkItem store or transport is unavailable; retry with the same Idempotency-Key",
        headers={"Retry-After": str(RETRY_AFTER_S)},
        # A schema that needs `agent-dispatch migrate` is a finding (1); an outage is 3.
        exit_code=EXIT_FAILURE if isinstance(exc, SchemaOutdated) else EXIT_UNAVAILABLE,
    )


def admission_result(error: ServiceError) -> str:
    """The admission metric's label for a refused turn."""
    if error.code == "depth_unavailable":
        return "depth_unavailable"
    return {413: "too_large", 422: "invalid", 400: "invalid", 409: "conflict", 429: "queue_full"}.get(
        error.status, "unavailable"
    )


def check_idempotency_key(key: str | None) -> str | None:
    if key is not None and not _IDEMPOTENCY.match(key):
        raise ServiceError(
            400,
            "invalid_header",
            "Idempotency-Key must be 1-200 printable characters without spaces",
            field="Idempotency-Key",
        )
    return key


class JobService:
    """A tenant's turns and jobs over one store and its admission strategy.

    ``admission`` is called on the first submission only, so a client that only reads or cancels
    jobs never opens a transport.
    """

    def __init__(self, settings: Settings, store: WorkItemStore, admission: Callable[[], Admission]) -> None:
        self.settings = settings
        self.store = store
        self._admission = admission

    @property
    def body_limit(self) -> int:
        """The largest request body worth reading: the payload bound plus room for the other fields."""
        return self.settings.max_payload_bytes + BODY_OVERHEAD

    def _payload(self, turn: TurnBody, prefix: str = "") -> bytes:
        """The payload as stored (compact JSON bytes), refused with 413 when over the limit."""
        payload = turn.payload_bytes()
        try:
            check_payload(payload, self.settings.max_payload_bytes)
        except PayloadTooLarge as exc:
            raise ServiceError(413, "payload_too_large", str(exc), field=f"{prefix}payload") from None
        return payload

    def call(self, fn: Callable[[], Any], *, missing: ServiceError | None = None) -> Any:
        """``fn()`` with its errors mapped; ``missing`` is the answer to a ``NotFound``."""
        try:
            return fn()
        except DispatchError as exc:
            mapped = missing if missing is not None and isinstance(exc, NotFound) else admission_error(exc)
            if mapped is None:
                raise
            raise mapped from None

    # --- turns -------------------------------------------------------------------------------

    def submit(
        self, tenant: str, body: bytes | Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> JobHandle:
        """Admit one turn (``body``: the JSON text or its parsed object)."""
        request = self.prepare(tenant, body, idempotency_key=idempotency_key)
        result: SubmitResult = self.call(lambda: self._admission().enqueue(request))
        return JobHandle.of(result.item, created=result.created)

    def prepare(
        self, tenant: str, body: bytes | Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> SubmitRequest:
        """The request one turn's body asks for, or the ServiceError (400/413/422) that refuses it."""
        key = check_idempotency_key(idempotency_key)
        try:
            turn = (
                TurnBody.model_validate_json(body)
                if isinstance(body, bytes)
                else TurnBody.model_validate(body)
            )
        except ValidationError as exc:
            raise validation_error(exc) from None
        return turn.to_request(tenant, key, datetime.now(UTC), self._payload(turn))

    def admit_many(self, requests: Sequence[SubmitRequest]) -> list[SubmitResult | DispatchError]:
        """Each prepared request's outcome, admitted together (the gateway's group commit).

        A lone request takes the single-turn path. An error of the whole call that is a refusal
        (e.g. the store is unavailable) is every request's outcome, as it would have been alone.
        """
        try:
            if len(requests) == 1:
                return [self._admission().enqueue(requests[0])]
            return list(self._admission().enqueue_many(requests))
        except DispatchError as exc:
            if admission_error(exc) is None:
                raise
            return [exc] * len(requests)

    @staticmethod
    def answer(outcome: SubmitResult | DispatchError) -> JobHandle:
        """The handle of an admitted (or replayed) turn; a refusal is raised as its ServiceError."""
        if isinstance(outcome, SubmitResult):
            return JobHandle.of(outcome.item, created=outcome.created)
        error = admission_error(outcome)
        if error is None:
            raise outcome
        raise error

    def submit_batch(self, tenant: str, body: bytes, *, idempotency_key: str | None = None) -> BatchResult:
        """Admit each turn of a batch; every turn gets its own result, one refusal hides no other.

        With an idempotency key, turn i without its own key uses ``<key>/<i>``.
        """
        key = check_idempotency_key(idempotency_key)
        try:
            batch = BatchBody.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        now = datetime.now(UTC)
        results: list[BatchItemResult | None] = [None] * len(batch.turns)
        valid: list[tuple[int, SubmitRequest]] = []
        for index, raw in enumerate(batch.turns):
            prefix = f"turns.{index}."
            try:
                try:
                    turn = BatchTurnBody.model_validate(raw)
                except ValidationError as exc:
                    raise validation_error(exc, prefix) from None
                payload = self._payload(turn, prefix)
                item_key = turn.idempotency_key or (f"{key}/{index}" if key is not None else None)
                valid.append((index, turn.to_request(tenant, item_key, now, payload)))
            except ServiceError as exc:
                results[index] = _refused(index, exc)
        if valid:
            outcomes = self.call(lambda: self._admission().enqueue_many([req for _, req in valid]))
            for (index, _), outcome in zip(valid, outcomes, strict=True):
                if isinstance(outcome, SubmitResult):
                    handle = JobHandle.of(outcome.item, created=outcome.created)
                    results[index] = BatchItemResult(index=index, status=202, **handle.body())
                    continue
                error = admission_error(outcome)
                if error is None:
                    raise outcome
                results[index] = _refused(index, error)
        done = [r for r in results if r is not None]
        return BatchResult(accepted=sum(1 for r in done if r.status == 202), results=done)

    # --- jobs --------------------------------------------------------------------------------

    def status(self, tenant: str, job_id: str) -> JobView:
        found = self.status_many([(tenant, job_id)])[0]
        if isinstance(found, ServiceError):
            raise found
        return JobView.model_validate(jobs.project(found))

    def status_many(self, asks: Sequence[tuple[str, str]]) -> list[WorkItem | ServiceError]:
        """The job of each ``(tenant, job id)`` asked for, from one read (the gateway's coalesced
        status reads; :func:`view_json` is its answer). A job that is not the asking tenant's is
        that ask's 404, as if absent; an error of the read itself (the store unavailable) is
        raised, every ask's answer alike."""
        wanted = [job_id for _, job_id in asks if _REF.match(job_id)]
        items = self.call(lambda: self.store.get_many(wanted))
        found: list[WorkItem | ServiceError] = []
        for tenant, job_id in asks:
            item = items.get(job_id)
            found.append(not_found() if item is None or item.tenant != tenant else item)
        return found

    def cancel(self, tenant: str, job_id: str) -> JobView:
        """Cancelling a finished job is not an error: the view says changed: false and how it ended."""
        if not _REF.match(job_id):
            # Not an id this service could have issued: indistinguishable from another tenant's job.
            raise not_found()
        view = self.call(
            lambda: jobs.graph_jobs(self.store, action="cancel", job_id=job_id, tenant=tenant),
            missing=not_found(),
        )
        return JobView.model_validate(view)

    def list(
        self,
        tenant: str,
        *,
        states: Sequence[str] = (),
        limit: int | str | None = None,
        after: str | None = None,
    ) -> JobList:
        """A page of the tenant's jobs, newest first; ``states`` may be comma-separated lists."""
        wanted = parse_states(states)
        page_size = parse_limit(limit)
        after = after or None
        bad_after = ServiceError(
            422, "invalid_field", "after: not a job id from a previous page", field="after"
        )
        if after is not None and not _REF.match(after):
            raise bad_after
        items = self.call(
            lambda: self.store.list_items(tenant=tenant, states=wanted, limit=page_size + 1, after=after),
            missing=bad_after,
        )
        page = items[:page_size]
        return JobList(
            jobs=[JobView.model_validate(jobs.project(item)) for item in page],
            next_after=page[-1].id if len(items) > page_size else None,
        )


def is_job_id(text: str) -> bool:
    """Whether ``text`` has the shape of an id this service issues (anything else is simply 404)."""
    return bool(_REF.match(text))


def _refused(index: int, error: ServiceError) -> BatchItemResult:
    return BatchItemResult.model_validate({"index": index, "status": error.status, **error.body()})


def parse_states(raw: Sequence[str]) -> list[WorkState]:
    states: list[WorkState] = []
    for text in raw:
        for name in filter(None, (part.strip() for part in text.split(","))):
            if name not in _STATES:
                raise ServiceError(
                    422,
                    "invalid_field",
                    f"state: {name[:40]!r} is not one of {', '.join(_STATES)}",
                    field="state",
                )
            states.append(_STATES[name])
    return states


def parse_limit(raw: int | str | None) -> int:
    if raw is None:
        return DEFAULT_PAGE
    text = str(raw)
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_PAGE:
        raise ServiceError(
            422, "invalid_field", f"limit: must be an integer from 1 to {MAX_PAGE}", field="limit"
        )
    return int(text)


__all__ = [
    "RETRY_AFTER_S",
    "JobService",
    "ServiceError",
    "admission_error",
    "admission_result",
    "check_idempotency_key",
    "validation_error",
]
