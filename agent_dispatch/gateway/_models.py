"""Request bodies of the gateway, validated strictly (unknown fields are errors, not ignored)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictInt, field_validator

from agent_dispatch.models import SubmitRequest

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

    kind: Annotated[str, Field(pattern=KIND_PATTERN)]
    payload: JsonValue
    session_id: Ref | None = None
    priority: Annotated[StrictInt, Field(ge=-1000, le=1000)] = 0
    deadline: float | str | None = None
    depends_on: Annotated[list[Ref], Field(max_length=MAX_DEPENDENCIES)] = []
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
