"""How ``submit`` and ``jobs`` reach jobs: over a gateway's HTTP API, or directly through the store.

Both clients answer with the same JSON shapes the gateway serves, so the commands print the
same thing either way. Failures become :class:`ClientError` carrying the CLI exit code.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import ValidationError

# Imported by command handlers only after agent_dispatch.cli has loaded, so this is not circular.
from agent_dispatch.cli import EXIT_FAILURE, EXIT_UNAVAILABLE, EXIT_USAGE
from agent_dispatch.settings import Settings

#: HTTP status -> CLI exit code: the caller's mistake is usage (2), an outage is 3, a refusal 1.
_EXIT_FOR_STATUS = {400: EXIT_USAGE, 401: EXIT_USAGE, 413: EXIT_USAGE, 422: EXIT_USAGE, 503: EXIT_UNAVAILABLE}
TIMEOUT_S = 30.0


class ClientError(Exception):
    def __init__(self, message: str, exit_code: int, *, status: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.status = status


class JobsClient(Protocol):
    def submit(self, turn: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]: ...

    def status(self, job_id: str) -> dict[str, Any]: ...

    def cancel(self, job_id: str) -> dict[str, Any]: ...

    def list(
        self, *, states: Sequence[str] = (), limit: int = 100, after: str | None = None
    ) -> dict[str, Any]: ...

    def close(self) -> None: ...


class HttpClient:
    """The gateway's HTTP API with a bearer token (stdlib only: the CLI needs no extra client)."""

    def __init__(self, url: str, token: str | None) -> None:
        self.base = url.rstrip("/")
        self.token = token

    def _call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(  # noqa: S310 - the URL scheme is validated by settings/argparse
            self.base + path, data=data, method=method
        )
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise _http_error(exc) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ClientError(f"gateway unreachable: {reason}", EXIT_UNAVAILABLE) from None

    def submit(self, turn: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        result: dict[str, Any] = self._call("POST", "/api/turns", turn, headers)
        return result

    def status(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/api/graph/jobs/{urllib.parse.quote(job_id, safe='')}")
        return result

    def cancel(self, job_id: str) -> dict[str, Any]:
        path = f"/api/graph/jobs/{urllib.parse.quote(job_id, safe='')}/cancel"
        result: dict[str, Any] = self._call("POST", path)
        return result

    def list(
        self, *, states: Sequence[str] = (), limit: int = 100, after: str | None = None
    ) -> dict[str, Any]:
        query: list[tuple[str, str]] = [("state", s) for s in states] + [("limit", str(limit))]
        if after:
            query.append(("after", after))
        result: dict[str, Any] = self._call("GET", "/api/graph/jobs?" + urllib.parse.urlencode(query))
        return result

    def close(self) -> None:
        pass


def _http_error(exc: urllib.error.HTTPError) -> ClientError:
    detail = exc.reason
    with contextlib.suppress(ValueError, AttributeError):
        body = json.loads(exc.read())
        detail = body.get("detail") or body.get("error") or detail
    if exc.code == 429:
        retry = exc.headers.get("Retry-After", "1")
        detail = f"{detail} (Retry-After: {retry}s)"
    return ClientError(
        f"HTTP {exc.code}: {detail}", _EXIT_FOR_STATUS.get(exc.code, EXIT_FAILURE), status=exc.code
    )


class DirectClient:
    """No gateway: the same validation and enqueue path, straight against the configured store."""

    def __init__(self, settings: Settings, tenant: str) -> None:
        from agent_dispatch import keys, stores, transports
        from agent_dispatch.errors import BackendUnavailable, SchemaOutdated

        self.settings = settings
        self.tenant = tenant
        try:
            self.signing_key = keys.signing_key(settings)
        except keys.SigningKeyMissing as exc:
            raise ClientError(str(exc), EXIT_USAGE) from None
        try:
            self.store = stores.open_store(settings)
        except (BackendUnavailable, SchemaOutdated) as exc:
            raise ClientError(str(exc), _exit_for(exc)) from None
        self._transport: Any = None
        self._open_transport = transports.open_transport

    @property
    def transport(self) -> Any:
        # Opened only to submit: reading or cancelling jobs needs the store alone.
        if self._transport is None:
            self._transport = self._guard(self._open_transport, self.settings)
        return self._transport

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from agent_dispatch.errors import (
            BackendUnavailable,
            DepthUnavailable,
            IdempotencyConflict,
            InvalidRequest,
            InvalidTransition,
            NotFound,
            PayloadTooLarge,
            QueueFull,
            SchemaOutdated,
        )

        try:
            return fn(*args, **kwargs)
        except NotFound:
            raise ClientError("no such job", EXIT_FAILURE, status=404) from None
        except QueueFull:
            raise ClientError(
                "the queue is at its depth bound; retry later", EXIT_FAILURE, status=429
            ) from None
        except DepthUnavailable:
            raise ClientError(
                "queue depth cannot be measured; retry later", EXIT_UNAVAILABLE, status=503
            ) from None
        except (PayloadTooLarge, InvalidRequest) as exc:
            raise ClientError(str(exc), EXIT_USAGE, status=422) from None
        except IdempotencyConflict:
            raise ClientError(
                "this idempotency key was already used for a different request", EXIT_FAILURE, status=409
            ) from None
        except InvalidTransition as exc:
            raise ClientError(str(exc), EXIT_FAILURE, status=409) from None
        except (BackendUnavailable, SchemaOutdated) as exc:
            raise ClientError(str(exc), _exit_for(exc)) from None

    def submit(self, turn: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        from agent_dispatch import dispatch
        from agent_dispatch.gateway import job_handle
        from agent_dispatch.gateway._models import TurnBody
        from agent_dispatch.store import check_payload

        try:
            body = TurnBody.model_validate(turn)
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[0]
            field = ".".join(str(p) for p in first["loc"]) or "body"
            raise ClientError(f"{field}: {first['msg']}", EXIT_USAGE, status=422) from None
        payload = body.payload_bytes()
        self._guard(check_payload, payload, self.settings.max_payload_bytes)
        request = body.to_request(self.tenant, idempotency_key, datetime.now(UTC), payload)
        result = self._guard(
            lambda: dispatch.enqueue(
                self.store, self.transport, request, signing_key=self.signing_key, settings=self.settings
            )
        )
        return job_handle(result.item, created=result.created)

    def status(self, job_id: str) -> dict[str, Any]:
        from agent_dispatch import jobs

        view: dict[str, Any] = self._guard(
            jobs.graph_jobs, self.store, action="status", job_id=job_id, tenant=self.tenant
        )
        return view

    def cancel(self, job_id: str) -> dict[str, Any]:
        from agent_dispatch import jobs

        view: dict[str, Any] = self._guard(
            jobs.graph_jobs, self.store, action="cancel", job_id=job_id, tenant=self.tenant
        )
        return view

    def list(
        self, *, states: Sequence[str] = (), limit: int = 100, after: str | None = None
    ) -> dict[str, Any]:
        from agent_dispatch import jobs
        from agent_dispatch.models import WorkState

        wanted = [WorkState(s) for s in states]
        items = self._guard(
            self.store.list_items, tenant=self.tenant, states=wanted, limit=limit + 1, after=after
        )
        page = items[:limit]
        return {
            "jobs": [jobs.project(item) for item in page],
            "next_after": page[-1].id if len(items) > limit else None,
        }

    def close(self) -> None:
        if self._transport is not None:
            with contextlib.suppress(Exception):
                self._transport.close()
        with contextlib.suppress(Exception):
            self.store.close()


def _exit_for(exc: Exception) -> int:
    from agent_dispatch.errors import SchemaOutdated

    # A schema that needs `agent-dispatch migrate` is a finding (1); an unreachable service is 3.
    return EXIT_FAILURE if isinstance(exc, SchemaOutdated) else EXIT_UNAVAILABLE


def open_client(settings: Settings, *, url: str | None, token: str | None, tenant: str) -> JobsClient:
    """The gateway at ``url`` (or AGENT_DISPATCH_GATEWAY_URL); with neither, the store directly."""
    url = url or settings.gateway_url
    if url:
        if token is None and settings.token is not None:
            token = settings.token.get_secret_value()
        return HttpClient(url, token)
    return DirectClient(settings, tenant)
