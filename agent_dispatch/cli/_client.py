"""How ``submit`` and ``jobs`` reach jobs: over a gateway's HTTP API, or directly through the store.

Both clients answer with the same JSON shapes the gateway serves, so the commands print the
same thing either way. Failures become :class:`ClientError` carrying the CLI exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from agent_dispatch.models import TERMINAL
from agent_dispatch.runtime import (
    EXIT_FAILURE,
    EXIT_UNAVAILABLE,
    Runtime,
    StartupError,
    open_runtime,
)
from agent_dispatch.settings import Settings

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
    from agent_dispatch.gateway.service import EXIT_FOR_STATUS

    detail = exc.reason
    with contextlib.suppress(ValueError, AttributeError):
        body = json.loads(exc.read())
        detail = body.get("detail") or body.get("error") or detail
    if exc.code == 429:
        retry = exc.headers.get("Retry-After", "1")
        detail = f"{detail} (Retry-After: {retry}s)"
    return ClientError(
        f"HTTP {exc.code}: {detail}", EXIT_FOR_STATUS.get(exc.code, EXIT_FAILURE), status=exc.code
    )


class DirectClient:
    """No gateway: the gateway's own service (validation, admission, pagination, tenant scoping),
    straight against the configured store."""

    def __init__(self, settings: Settings, tenant: str) -> None:
        from agent_dispatch.gateway.service import JobService

        self.settings = settings
        self.tenant = tenant
        try:
            # The transport is opened only to submit: reading or cancelling jobs needs the store alone.
            self.runtime: Runtime = open_runtime(settings, transport=False)
        except StartupError as exc:
            raise ClientError(str(exc), exc.exit_code) from None
        self.store = self.runtime.store
        self.service = JobService(settings, self.store, lambda: self.runtime.admission)

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from agent_dispatch.gateway.service import ServiceError

        try:
            answer: dict[str, Any] = fn(*args, **kwargs).body()
        except ServiceError as exc:
            raise ClientError(exc.detail, exc.exit_code, status=exc.status) from None
        except StartupError as exc:
            raise ClientError(str(exc), exc.exit_code) from None
        return answer

    def submit(self, turn: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        return self._guard(self.service.submit, self.tenant, turn, idempotency_key=idempotency_key)

    def status(self, job_id: str) -> dict[str, Any]:
        return self._guard(self.service.status, self.tenant, job_id)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._guard(self.service.cancel, self.tenant, job_id)

    def list(
        self, *, states: Sequence[str] = (), limit: int = 100, after: str | None = None
    ) -> dict[str, Any]:
        return self._guard(self.service.list, self.tenant, states=states, limit=limit, after=after)

    def close(self) -> None:
        self.runtime.close()


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """Where jobs live: a gateway (URL + token) or, without a URL, the configured store."""
    parser.add_argument(
        "--url",
        metavar="URL",
        help="gateway URL (default: AGENT_DISPATCH_GATEWAY_URL; unset: the store directly)",
    )
    parser.add_argument(
        "--token",
        metavar="TOKEN",
        help="bearer token for --url (default: AGENT_DISPATCH_TOKEN; prefer the variable)",
    )
    parser.add_argument(
        "--tenant",
        default="local",
        metavar="TENANT",
        help="tenant when talking to the store directly (default: local; a gateway takes it from the token)",
    )


def wait_terminal(
    client: JobsClient, job_id: str, *, timeout_s: float, interval_s: float = 0.2
) -> dict[str, Any]:
    """Poll until the job is terminal; ClientError when it takes longer than ``timeout_s``."""
    terminal = {state.value for state in TERMINAL}
    deadline = time.monotonic() + timeout_s
    while True:
        view: dict[str, Any] = client.status(job_id)
        if view.get("state") in terminal:
            return view
        if time.monotonic() >= deadline:
            raise ClientError(f"job {job_id} still {view.get('state')} after {timeout_s:g}s", EXIT_FAILURE)
        time.sleep(interval_s)


def open_client(settings: Settings, *, url: str | None, token: str | None, tenant: str) -> JobsClient:
    """The gateway at ``url`` (or AGENT_DISPATCH_GATEWAY_URL); with neither, the store directly."""
    url = url or settings.gateway_url
    if url:
        if token is None and settings.token is not None:
            token = settings.token.get_secret_value()
        return HttpClient(url, token)
    return DirectClient(settings, tenant)


def run_with_client(
    settings: Settings, args: argparse.Namespace, command: str, body: Callable[[JobsClient], int]
) -> int:
    """Open the client the options name, run ``body`` with it and close it; a ``ClientError`` is
    printed once, as ``agent-dispatch <command>: ...``, and becomes the exit code."""
    client = None
    try:
        client = open_client(settings, url=args.url, token=args.token, tenant=args.tenant)
        return body(client)
    except ClientError as exc:
        print(f"agent-dispatch {command}: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        if client is not None:
            client.close()
