"""Typed errors. A stale worker always gets one of these, never a silent success."""

from __future__ import annotations


class DispatchError(Exception):
    """Base of every agent-dispatch error."""


class NotFound(DispatchError):
    """No such WorkItem (or it belongs to another tenant: isolation hides it)."""


class TenantMismatch(DispatchError):
    """A fenced call named a tenant that does not own the WorkItem."""


class InvalidTransition(DispatchError):
    """The state machine does not allow this transition (terminal states are final)."""


class LeaseLost(DispatchError):
    """The caller's lease is no longer current; it must stop and cause no side effect."""


class Fenced(LeaseLost):
    """A newer lease (higher epoch / fencing token) or another owner holds the WorkItem."""


class LeaseExpired(LeaseLost):
    """The lease ran past its expiry by the database clock."""


class Cancelled(LeaseLost):
    """The WorkItem was cancelled while the caller held its lease."""


class LeaseHeld(DispatchError):
    """A live lease held by another worker prevents this claim (redeliver later)."""


class PayloadTooLarge(DispatchError):
    """The payload is over the configured size bound; nothing was stored."""


class IdempotencyConflict(DispatchError):
    """An idempotency key or explicit id was reused with a different request."""


class AdmissionRejected(DispatchError):
    """Fail-closed admission refused the turn."""


class QueueFull(AdmissionRejected):
    """Accepted depth is at the bound."""


class DepthUnavailable(AdmissionRejected):
    """The depth probe failed; an unknown depth is never treated as empty."""


class PoisonEnvelope(DispatchError):
    """An envelope that is forged, unsigned, malformed or references no WorkItem."""


class BackendUnavailable(DispatchError):
    """An explicitly selected backend cannot be reached."""


class SchemaOutdated(DispatchError):
    """The database schema is older than this code; run ``agent-dispatch migrate``."""


class InvalidRequest(DispatchError, ValueError):
    """A request the store refuses before touching anything (no tenant, bad priority, self-dependency)."""
