"""The gateway's request bodies (validated strictly: unknown fields are errors) and answers.

The OpenAPI document (:mod:`agent_dispatch.gateway._openapi`) is generated from these models.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictInt, field_validator

from agent_dispatch.models import Outcome, SubmitRequest, WorkItem, WorkState

#: The envelope's reference shape (ids, sessions): a body that passes here always seals.
REF_PATTERN: Final = r"^[A-Za-z0-9._:@/+=-]{1,200}$"
KIND_PATTERN: Final = r"^[A-Za-z0-9._-]{1,64}$"
IDEMPOTENCY_KEY_PATTERN: Final = r"^[\x21-\x7e]{1,200}$"
#: A relative deadline of more than a year is almost certainly a unit mistake (ms for s).
MAX_DEADLINE_S: Final = 366 * 24 * 3600
MAX_DEPENDENCIES: Final = 100
MAX_BATCH: Final = 500
#: Room for the fields around the payload in a request body (the payload itself is bounded exactly).
BODY_OVERHEAD: Final = 64 * 1024
DEFAULT_PAGE: Final = 100
MAX_PAGE: Final = 1000

Ref = Annotated[str, Field(pattern=REF_PATTERN)]


class TurnBody(BaseModel):
    """``POST /api/turns``. The tenant is never part of it: it comes from the bearer token."""

    model_config = ConfigDict(extra="forbid")

    kind: Annotated[str, Field(pattern=KIND_PATTERN, description="Executor-defined turn kind")]
    payload: JsonValue = Field(description="Any JSON value (no NaN/Infinity); stored as compact UTF-8 JSON")
    session_id: Ref | None = Field(
        None, description="Turns of one session run one at a time, in order; default: the job id"
    )
    priority: Annotated[StrictInt, Field(ge=-1000, le=1000)] = 0
    deadline: float | str | None = Field(
        None,
        description="After it, the turn is cancelled instead of run. RFC 3339 with an offset, or seconds from now",
        json_schema_extra={
            "oneOf": [
                {"type": "string", "format": "date-time"},
                {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_DEADLINE_S},
            ]
        },
    )
    depends_on: Annotated[list[Ref], Field(max_length=MAX_DEPENDENCIES)] = Field(
        [], description="Job ids of this tenant that must succeed first"
    )
    max_attempts: Annotated[StrictInt, Field(ge=1, le=100)] | None = None

    @field_validator("deadline", mode="plain")
    @classmethod
    def _deadline(cls, value: Any) -> float | str | None:
        # One plain validator (not a union of types) so a bad value gets one error naming the field.
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float | str)):
            raise ValueError("must be an RFC 3339 timestamp or a number of seconds from now")
        parse_deadline(value, datetime.now(UTC))  # validated now; converted against the request time
        return value

    @field_validator("payload")
    @classmethod
    def _finite(cls, value: JsonValue) -> JsonValue:
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            raise ValueError("must be JSON without NaN or Infinity") from None
        return value

    def payload_bytes(self) -> bytes:
        # Compact and stable: the stored bytes are what an executor reads back.
        return json.dumps(self.payload, separators=(",", ":"), ensure_ascii=False).encode()

    def to_request(
        self, tenant: str, idempotency_key: str | None, now: datetime, payload: bytes
    ) -> SubmitRequest:
        """``payload`` is :meth:`payload_bytes`, encoded once by the caller that bounds its size."""
        return SubmitRequest(
            tenant=tenant,
            kind=self.kind,
            payload=payload,
            session_id=self.session_id,
            priority=self.priority,
            deadline=parse_deadline(self.deadline, now),
            idempotency_key=idempotency_key,
            depends_on=tuple(self.depends_on),
            max_attempts=self.max_attempts,
        )


class BatchTurnBody(TurnBody):
    """One turn of a batch; it may carry its own idempotency key."""

    idempotency_key: Annotated[str, Field(pattern=IDEMPOTENCY_KEY_PATTERN)] | None = None


class BatchBody(BaseModel):
    """``POST /api/turns:batch``: the items are validated one by one, each with its own result."""

    model_config = ConfigDict(extra="forbid")

    turns: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_BATCH)]


def parse_deadline(value: float | str | None, now: datetime) -> datetime | None:
    """RFC 3339 with an offset, or seconds from now; a deadline already past is an error."""
    if value is None:
        return None
    if isinstance(value, int | float):
        if not 0 < value <= MAX_DEADLINE_S:
            raise ValueError(f"seconds from now must be above 0 and at most {MAX_DEADLINE_S}")
        return now + timedelta(seconds=float(value))
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError("must be an RFC 3339 timestamp (e.g. 2030-01-01T00:00:00Z) or seconds") from None
    if moment.tzinfo is None:
        raise ValueError("must carry a UTC offset (e.g. Z or +02:00)")
    try:
        moment = moment.astimezone(UTC)
    except OverflowError:
        raise ValueError("is out of range") from None
    if moment <= now:
        raise ValueError("is already in the past")
    return moment


# --- answers ---------------------------------------------------------------------------------
# Every answer body is built through one of these models, and the OpenAPI document is generated
# from them, so what is served and what is documented cannot drift apart.

#: An ISO 8601 timestamp as the store's projection writes it (kept as text: re-parsing it would
#: change its spelling between the gateway and the direct CLI client).
Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]


class Answer(BaseModel):
    """Answers carry only the fields set when they were built (absent, not null, otherwise)."""

    model_config = ConfigDict(extra="forbid")

    def body(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)

    def json_bytes(self) -> bytes:
        """:meth:`body` as JSON text, encoded."""
        return self.model_dump_json(exclude_unset=True).encode()


class JobHandle(Answer):
    """The answer to an accepted submission."""

    job_id: str
    work_item_id: str
    session_id: str
    state: WorkState
    status_url: str = Field(description="Path of the job's status")
    created: bool = Field(description="false when an Idempotency-Key matched an earlier submission")

    @classmethod
    def of(cls, item: WorkItem, *, created: bool) -> JobHandle:
        return cls(
            job_id=item.id,
            work_item_id=item.id,
            session_id=item.session_id,
            state=item.state,
            status_url=f"/api/graph/jobs/{item.id}",
            created=created,
        )


class Timestamps(Answer):
    created_at: Timestamp
    updated_at: Timestamp
    deadline: Timestamp | None
    lease_expires_at: Timestamp | None
    not_before: Timestamp | None


class JobView(Answer):
    """The WorkItem itself (there is no second status record); never the payload."""

    job_id: str
    tenant: str
    kind: str
    queue: str
    session_id: str
    state: WorkState
    terminal: bool
    attempt: Annotated[int, Field(ge=0)]
    max_attempts: Annotated[int, Field(ge=1)]
    lease_epoch: Annotated[int, Field(ge=0)]
    fencing_token: Annotated[int, Field(ge=0)]
    lease_owner: str | None
    priority: int
    depends_on: list[str]
    timestamps: Timestamps
    outcome: Outcome | None
    error: str | None
    changed: bool | None = Field(
        None, description="cancel only: false when the job had already finished (it shows how)"
    )


class JobList(Answer):
    jobs: list[JobView]
    next_after: str | None = Field(description="Pass as `after` for the next page; null on the last page")


class FieldError(Answer):
    field: str
    message: str


class ErrorBody(Answer):
    error: str = Field(description="A stable machine-readable code")
    detail: str
    field: str | None = Field(None, description="The request field or header at fault")
    errors: list[FieldError] | None = None


class BatchItemResult(Answer):
    """A job handle (status 202) or an error (any other status) for one turn of a batch."""

    index: Annotated[int, Field(ge=0)]
    status: Literal[202, 400, 409, 413, 422, 429, 503]
    job_id: str | None = None
    work_item_id: str | None = None
    session_id: str | None = None
    state: WorkState | None = None
    status_url: str | None = None
    created: bool | None = None
    error: str | None = None
    detail: str | None = None
    field: str | None = None
    errors: list[FieldError] | None = None


class BatchResult(Answer):
    accepted: Annotated[int, Field(ge=0)]
    results: list[BatchItemResult]
