"""Executors: what runs a turn. Plugins are ``module:function``; built-ins are noop, sleep and http.

An executor is called as ``fn(envelope, payload, lease_guard, logger)``. Returning means success;
raising :class:`TurnFailed` records a failure (retryable or not); any other exception is a
retryable failure. Every mutation of the outside world goes through ``lease_guard.side_effect``.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from agent_dispatch.envelope import AgentTurnEnvelope
from agent_dispatch.errors import LeaseLost
from agent_dispatch.lease import WorkItemLeaseGuard
from agent_dispatch.settings import Settings

Executor = Callable[[AgentTurnEnvelope, bytes, WorkItemLeaseGuard, logging.Logger], Any]


class TurnFailed(Exception):
    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def run_executor(
    executor: Executor,
    envelope: AgentTurnEnvelope,
    payload: bytes,
    guard: WorkItemLeaseGuard,
    logger: logging.Logger,
) -> TurnFailed | None:
    """Run one turn; its failure as a ``TurnFailed`` (an unexpected exception is retryable), or
    None. A lost lease propagates: it is not the turn's failure."""
    try:
        executor(envelope, payload, guard, logger)
    except LeaseLost:
        raise
    except TurnFailed as exc:
        return exc
    except Exception as exc:
        return TurnFailed(f"{type(exc).__name__}: {exc}", retryable=True)
    return None


def noop(
    envelope: AgentTurnEnvelope, payload: bytes, guard: WorkItemLeaseGuard, logger: logging.Logger
) -> None:
    """Does nothing: for demos and for measuring the dispatcher itself."""


#: How often the sleep executor asks the store whether its turn was cancelled (one read).
SLEEP_VERIFY_S = 0.5


def sleep(
    envelope: AgentTurnEnvelope, payload: bytes, guard: WorkItemLeaseGuard, logger: logging.Logger
) -> None:
    """Sleeps ``{"sleep_s": n}`` seconds (default 1); a cancellation or a lost lease ends it within
    :data:`SLEEP_VERIFY_S`, freeing the worker slot, not at the next renewal."""
    try:
        seconds = float(json.loads(payload or b"{}").get("sleep_s", 1.0))
    except (ValueError, AttributeError, TypeError):
        raise TurnFailed("payload must be JSON with a numeric sleep_s", retryable=False) from None
    deadline = time.monotonic() + max(seconds, 0.0)
    verify_at = time.monotonic() + SLEEP_VERIFY_S
    while (left := deadline - time.monotonic()) > 0:
        if guard.lost.wait(min(left, 0.05)):
            guard.check()
        if time.monotonic() >= verify_at:
            guard.verify()
            verify_at = time.monotonic() + SLEEP_VERIFY_S


def http_executor(settings: Settings) -> Executor:
    """POST the turn to the agent endpoint, with the fencing token, epoch and an idempotency key."""
    url = settings.executor_url
    if url is None:  # settings validation already requires it; this keeps mypy and readers honest
        raise ValueError("AGENT_DISPATCH_EXECUTOR_URL is required for the http executor")
    timeout = settings.executor_timeout_s

    def run(
        envelope: AgentTurnEnvelope, payload: bytes, guard: WorkItemLeaseGuard, logger: logging.Logger
    ) -> None:
        request = urllib.request.Request(  # noqa: S310 - the URL scheme is validated by settings
            url,
            data=payload,
            method="POST",
            headers={
                "Content-Type": "application/octet-stream",
                "Idempotency-Key": envelope.job_id,
                "X-Agent-Dispatch-Job-Id": envelope.job_id,
                "X-Agent-Dispatch-Session-Id": envelope.session_id,
                "X-Agent-Dispatch-Tenant": envelope.tenant,
                "X-Agent-Dispatch-Kind": envelope.kind,
                "X-Agent-Dispatch-Fencing-Token": str(guard.fencing_token),
                "X-Agent-Dispatch-Lease-Epoch": str(guard.lease_epoch),
            },
        )

        def post() -> int:
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
                    return int(response.status)
            except urllib.error.HTTPError as exc:
                return int(exc.code)
            except (urllib.error.URLError, TimeoutError, OSError) as exc:
                raise TurnFailed(
                    f"agent endpoint unreachable: {type(exc).__name__}", retryable=True
                ) from None

        status = guard.side_effect(post)
        if 400 <= status < 500:
            raise TurnFailed(f"agent endpoint refused the turn: HTTP {status}", retryable=False)
        if status >= 500:
            raise TurnFailed(f"agent endpoint failed: HTTP {status}", retryable=True)

    return run


def load_executor(settings: Settings) -> Executor:
    spec = settings.executor
    if spec == "noop":
        return noop
    if spec == "sleep":
        return sleep
    if spec == "http":
        return http_executor(settings)
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"AGENT_DISPATCH_EXECUTOR={spec!r} cannot be loaded: {exc}") from None
    if not callable(fn):
        raise ValueError(f"AGENT_DISPATCH_EXECUTOR={spec!r} is not callable")
    return fn  # type: ignore[no-any-return]
