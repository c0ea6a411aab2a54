"""AgentTurnEnvelope: the signed, minimal message a transport carries.

It carries only references (invariant 11): the body lives in the WorkItem store. It is signed
with HMAC-SHA256 so that a process able to write to the topic or table cannot inject turns;
anything forged, unsigned, malformed or oversized is :class:`PoisonEnvelope`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from datetime import UTC, datetime
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent_dispatch.errors import PoisonEnvelope

MAX_ENVELOPE_BYTES: Final = 4096
WIRE_VERSION: Final = 1

_Ref = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@/+=-]+$")]


class AgentTurnEnvelope(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    job_id: _Ref
    session_id: _Ref
    kind: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
    payload_ref: _Ref
    tenant: _Ref
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    deadline: float | None = None  # unix seconds; None: no deadline
    attempt: Annotated[int, Field(ge=0, le=1000)] = 0
    enqueued_at: float

    def expired(self, now: datetime | None = None) -> bool:
        if self.deadline is None:
            return False
        return (now or datetime.now(UTC)).timestamp() >= self.deadline

    @property
    def deadline_at(self) -> datetime | None:
        return None if self.deadline is None else datetime.fromtimestamp(self.deadline, UTC)


def _canonical(envelope: AgentTurnEnvelope) -> bytes:
    return json.dumps(envelope.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


def _mac(key: bytes, body: bytes) -> str:
    return base64.urlsafe_b64encode(hmac.new(key, body, hashlib.sha256).digest()).decode().rstrip("=")


#: How :func:`seal` lays a wire out around the signed bytes (the signature is base64url: no quote).
_WIRE_HEAD: Final = b'{"v":%d,"env":' % WIRE_VERSION
_WIRE_SIG: Final = b',"sig":"'
_WIRE_TAIL: Final = b'"}'


def seal(envelope: AgentTurnEnvelope, key: bytes) -> bytes:
    """Wire bytes: ``{"v":1,"env":{...},"sig":...}`` with the HMAC over the canonical envelope."""
    body = _canonical(envelope)
    wire = _WIRE_HEAD + body + _WIRE_SIG + _mac(key, body).encode() + _WIRE_TAIL
    if len(wire) > MAX_ENVELOPE_BYTES:
        raise PoisonEnvelope(f"envelope is {len(wire)} bytes; the limit is {MAX_ENVELOPE_BYTES}")
    return wire


def _as_sealed(wire: bytes, key: bytes) -> AgentTurnEnvelope | None:
    """The envelope of a wire laid out exactly as :func:`seal` writes it, verified over the very
    bytes it carries (no re-encoding: that was a tenth of a worker's CPU); None for anything else,
    which :func:`open_envelope` then takes apart field by field to say what is wrong with it."""
    if not (wire.startswith(_WIRE_HEAD) and wire.endswith(_WIRE_TAIL)):
        return None
    cut = wire.rfind(_WIRE_SIG)
    if cut < len(_WIRE_HEAD):
        return None
    body, signature = wire[len(_WIRE_HEAD) : cut], wire[cut + len(_WIRE_SIG) : -len(_WIRE_TAIL)]
    if not hmac.compare_digest(signature, _mac(key, body).encode()):
        return None
    try:
        # The same parse and the same strict validation as below, of bytes the key signed.
        fields = json.loads(body)
        return AgentTurnEnvelope.model_validate(fields) if isinstance(fields, dict) else None
    except (ValueError, ValidationError):
        return None


def open_envelope(wire: bytes, key: bytes) -> AgentTurnEnvelope:
    """Verify and parse; every way of being wrong raises :class:`PoisonEnvelope` with a reason."""
    if not isinstance(wire, bytes | bytearray | memoryview):
        raise PoisonEnvelope("envelope is not bytes")
    if len(wire) > MAX_ENVELOPE_BYTES:
        raise PoisonEnvelope(f"envelope is {len(wire)} bytes; the limit is {MAX_ENVELOPE_BYTES}")
    data = bytes(wire)
    sealed = _as_sealed(data, key)
    if sealed is not None:
        return sealed
    try:
        outer: Any = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PoisonEnvelope(f"malformed envelope: {type(exc).__name__}") from None
    if not isinstance(outer, dict) or set(outer) != {"v", "env", "sig"}:
        raise PoisonEnvelope("malformed envelope: expected exactly v, env, sig")
    if outer["v"] != WIRE_VERSION:
        raise PoisonEnvelope(f"unsupported envelope version {outer['v']!r}")
    signature = outer["sig"]
    if not isinstance(signature, str) or not signature:
        raise PoisonEnvelope("unsigned envelope")
    try:
        envelope = AgentTurnEnvelope.model_validate(outer["env"])
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or "envelope"
        raise PoisonEnvelope(f"invalid envelope field {field}: {first['msg']}") from None
    # compare_digest refuses (TypeError) a str with non-ASCII characters: that is a bad signature too.
    if not signature.isascii() or not hmac.compare_digest(signature, _mac(key, _canonical(envelope))):
        raise PoisonEnvelope("envelope signature does not verify")
    return envelope


def peek_job_id(wire: bytes) -> str | None:
    """Best-effort job id of an unverifiable envelope, for dead-letter records only (never trusted)."""
    try:
        env = json.loads(bytes(wire)).get("env", {})
        job_id = env.get("job_id")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None
    return job_id if isinstance(job_id, str) and len(job_id) <= 200 else None
