"""The gateway's aiohttp application: admission over HTTP, job status and cancellation.

It never runs a turn: a request is validated, admitted through :func:`agent_dispatch.dispatch.enqueue`
and answered with a job handle. Store and transport calls block (database drivers, the Kafka
flush barrier), so they run on a bounded thread pool and the event loop only moves bytes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, ParamSpec, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from agent_dispatch import dispatch, jobs
from agent_dispatch.errors import (
    BackendUnavailable,
    DepthUnavailable,
    DispatchError,
    IdempotencyConflict,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    SchemaOutdated,
)
from agent_dispatch.gateway import _metrics as m
from agent_dispatch.gateway._auth import TokenRegistry
from agent_dispatch.gateway._models import (
    BODY_OVERHEAD,
    DEFAULT_PAGE,
    IDEMPOTENCY_KEY_PATTERN,
    MAX_PAGE,
    REF_PATTERN,
    BatchBody,
    BatchTurnBody,
    TurnBody,
)
from agent_dispatch.gateway._openapi import openapi_document
from agent_dispatch.models import SubmitRequest, SubmitResult, WorkItem, WorkState
from agent_dispatch.settings import Settings
from agent_dispatch.store import WorkItemStore, check_payload
from agent_dispatch.transport import Transport

log = logging.getLogger("agent_dispatch.gateway")

P = ParamSpec("P")
R = TypeVar("R")

#: What a client is told to wait after 429/503; the queue drains at worker speed, so retry soon.
RETRY_AFTER_S: Final = 1
THREADS: Final = 16

_IDEMPOTENCY = re.compile(IDEMPOTENCY_KEY_PATTERN)
_REF = re.compile(REF_PATTERN)
_STATES: Final = {s.value: s for s in WorkState}


class ApiError(Exception):
    """An error answer: status, a stable machine code, a human detail, and the field at fault."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        *,
        field: str | None = None,
        headers: Mapping[str, str] | None = None,
        errors: Sequence[Mapping[str, str]] = (),
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.field = field
        self.headers = dict(headers or {})
        self.errors = list(errors)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.code, "detail": self.detail}
        if self.field is not None:
            out["field"] = self.field
        if self.errors:
            out["errors"] = self.errors
        return out

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def _loc(loc: Sequence[int | str]) -> str:
    return ".".join(str(part) for part in loc) or "body"


def validation_error(exc: ValidationError, prefix: str = "") -> ApiError:
    """422 naming the first bad field (400 when the body is not JSON at all)."""
    details = exc.errors(include_url=False, include_input=False)
    if details and details[0]["type"] in {"json_invalid", "json_type"}:
        return ApiError(400, "malformed_json", "the request body is not valid JSON", field="body")
    errors = [
        {"field": prefix + _loc(d["loc"]), "message": str(d["msg"]).removeprefix("Value error, ")}
        for d in details
    ]
    first = errors[0]
    return ApiError(
        422, "invalid_field", f"{first['field']}: {first['message']}", field=first["field"], errors=errors
    )


def admission_error(exc: Exception) -> ApiError | None:
    """The HTTP meaning of an error from the enqueue path; ``None`` for anything unexpected."""
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(exc, QueueFull):
        return ApiError(429, "queue_full", "the queue is at its depth bound; retry later", headers=retry)
    if isinstance(exc, DepthUnavailable):
        # Fail closed: an unknown depth is never treated as an empty queue.
        return ApiError(
            503, "depth_unavailable", "queue depth cannot be measured; retry later", headers=retry
        )
    if isinstance(exc, PayloadTooLarge):
        return ApiError(413, "payload_too_large", str(exc), field="payload")
    if isinstance(exc, IdempotencyConflict):
        return ApiError(
            409,
            "idempotency_conflict",
            "this Idempotency-Key was already used for a different request",
            field="Idempotency-Key",
        )
    if isinstance(exc, NotFound):
        return ApiError(422, "invalid_field", "depends_on: a dependency does not exist", field="depends_on")
    if isinstance(exc, InvalidRequest):
        return ApiError(422, "invalid_request", str(exc))
    if isinstance(exc, BackendUnavailable | SchemaOutdated):
        return ApiError(
            503,
            "unavailable",
            "the WorkItem store or transport is unavailable; retry with the same Idempotency-Key",
            headers=retry,
        )
    return None


_RESULT_OF: Final[dict[int, str]] = {
    413: "too_large",
    422: "invalid",
    400: "invalid",
    409: "conflict",
    429: "queue_full",
}


def _admission_result(error: ApiError) -> str:
    if error.code == "depth_unavailable":
        return "depth_unavailable"
    return _RESULT_OF.get(error.status, "unavailable")


def job_handle(item: WorkItem, *, created: bool) -> dict[str, Any]:
    return {
        "job_id": item.id,
        "work_item_id": item.id,
        "session_id": item.session_id,
        "state": item.state.value,
        "status_url": f"/api/graph/jobs/{item.id}",
        "created": created,
    }


@dataclass
class Gateway:
    settings: Settings
    store: WorkItemStore
    transport: Transport
    signing_key: bytes
    tokens: TokenRegistry
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="gateway-io")
    )

    @property
    def body_limit(self) -> int:
        return self.settings.max_payload_bytes + BODY_OVERHEAD

    async def blocking(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    # --- request plumbing ----------------------------------------------------------------------

    def tenant_of(self, request: web.Request) -> str:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        challenge = 'Bearer realm="agent-dispatch"'
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401, "unauthenticated", "a bearer token is required", headers={"WWW-Authenticate": challenge}
            )
        tenant = self.tokens.authenticate(token.strip())
        if tenant is None:
            raise ApiError(
                401,
                "invalid_token",
                "the bearer token is not valid",
                headers={"WWW-Authenticate": f'{challenge}, error="invalid_token"'},
            )
        return tenant

    async def read_body(self, request: web.Request) -> bytes:
        limit = self.body_limit
        too_large = ApiError(
            413,
            "payload_too_large",
            f"the request body is over {limit} bytes (payload limit {self.settings.max_payload_bytes})",
            field="body",
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        if len(body) > limit:
            raise too_large
        return body

    def idempotency_key(self, request: web.Request) -> str | None:
        key = request.headers.get("Idempotency-Key")
        if key is None:
            return None
        if not _IDEMPOTENCY.match(key):
            raise ApiError(
                400,
                "invalid_header",
                "Idempotency-Key must be 1-200 printable characters without spaces",
                field="Idempotency-Key",
            )
        return key

    def check_payload(self, turn: TurnBody, prefix: str = "") -> bytes:
        """The payload as stored (compact JSON bytes), refused with 413 when over the limit."""
        payload = turn.payload_bytes()
        try:
            check_payload(payload, self.settings.max_payload_bytes)
        except PayloadTooLarge as exc:
            raise ApiError(413, "payload_too_large", str(exc), field=f"{prefix}payload") from None
        return payload

    def enqueue(self, request: SubmitRequest) -> SubmitResult:
        return dispatch.enqueue(
            self.store, self.transport, request, signing_key=self.signing_key, settings=self.settings
        )

    # --- turns -------------------------------------------------------------------------------

    async def submit(self, request: web.Request) -> web.Response:
        tenant = self.tenant_of(request)
        key = self.idempotency_key(request)
        try:
            body = await self.read_body(request)
            try:
                turn = TurnBody.model_validate_json(body)
            except ValidationError as exc:
                raise validation_error(exc) from None
            payload = self.check_payload(turn)
            submit_request = turn.to_request(tenant, key, datetime.now(UTC), payload)
            try:
                result = await self.blocking(self.enqueue, submit_request)
            except DispatchError as exc:
                mapped = admission_error(exc)
                if mapped is None:
                    raise
                raise mapped from None
        except ApiError as exc:
            m.ADMISSIONS.labels(_admission_result(exc)).inc()
            raise
        m.ADMISSIONS.labels("accepted" if result.created else "duplicate").inc()
        handle = job_handle(result.item, created=result.created)
        return web.json_response(handle, status=202, headers={"Location": handle["status_url"]})

    async def submit_batch(self, request: web.Request) -> web.Response:
        tenant = self.tenant_of(request)
        key = self.idempotency_key(request)
        body = await self.read_body(request)
        try:
            batch = BatchBody.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        now = datetime.now(UTC)
        results: list[dict[str, Any] | None] = [None] * len(batch.turns)
        valid: list[tuple[int, SubmitRequest]] = []
        for index, raw in enumerate(batch.turns):
            prefix = f"turns.{index}."
            try:
                try:
                    turn = BatchTurnBody.model_validate(raw)
                except ValidationError as exc:
                    raise validation_error(exc, prefix) from None
                payload = self.check_payload(turn, prefix)
                item_key = turn.idempotency_key or (f"{key}/{index}" if key is not None else None)
                valid.append((index, turn.to_request(tenant, item_key, now, payload)))
            except ApiError as exc:
                m.ADMISSIONS.labels(_admission_result(exc)).inc()
                results[index] = {"index": index, "status": exc.status, **exc.body()}
        if valid:
            outcomes = await self.blocking(self.enqueue_each, [req for _, req in valid])
            for (index, _), outcome in zip(valid, outcomes, strict=True):
                if isinstance(outcome, ApiError):
                    m.ADMISSIONS.labels(_admission_result(outcome)).inc()
                    results[index] = {"index": index, "status": outcome.status, **outcome.body()}
                else:
                    m.ADMISSIONS.labels("accepted" if outcome.created else "duplicate").inc()
                    results[index] = {
                        "index": index,
                        "status": 202,
                        **job_handle(outcome.item, created=outcome.created),
                    }
        accepted = sum(1 for r in results if r is not None and r["status"] == 202)
        return web.json_response({"accepted": accepted, "results": results}, status=200)

    def enqueue_each(self, requests: Sequence[SubmitRequest]) -> list[SubmitResult | ApiError]:
        """Every turn of a batch gets its own outcome; one refusal never hides the others."""
        outcomes = dispatch.enqueue_many(
            self.store, self.transport, requests, signing_key=self.signing_key, settings=self.settings
        )
        mapped: list[SubmitResult | ApiError] = []
        for outcome in outcomes:
            if isinstance(outcome, SubmitResult):
                mapped.append(outcome)
                continue
            error = admission_error(outcome)
            if error is None:
                raise outcome
            mapped.append(error)
        return mapped

    # --- jobs --------------------------------------------------------------------------------

    def job_id_of(self, request: web.Request) -> str:
        job_id = request.match_info["job_id"]
        if not _REF.match(job_id):
            # Not an id this gateway could have issued: indistinguishable from another tenant's job.
            raise ApiError(404, "not_found", "no such job")
        return job_id

    async def job_status(self, request: web.Request) -> web.Response:
        tenant = self.tenant_of(request)
        job_id = self.job_id_of(request)
        try:
            view = await self.blocking(
                jobs.graph_jobs, self.store, action="status", job_id=job_id, tenant=tenant
            )
        except NotFound:
            raise ApiError(404, "not_found", "no such job") from None
        return web.json_response(view)

    async def job_cancel(self, request: web.Request) -> web.Response:
        tenant = self.tenant_of(request)
        job_id = self.job_id_of(request)
        try:
            # Cancelling a finished job is not an error: the view says changed: false and how it ended.
            view = await self.blocking(
                jobs.graph_jobs, self.store, action="cancel", job_id=job_id, tenant=tenant
            )
        except NotFound:
            raise ApiError(404, "not_found", "no such job") from None
        return web.json_response(view)

    async def job_list(self, request: web.Request) -> web.Response:
        tenant = self.tenant_of(request)
        query = request.query
        states: list[WorkState] = []
        for raw in query.getall("state", []):
            for name in filter(None, (part.strip() for part in raw.split(","))):
                if name not in _STATES:
                    raise ApiError(
                        422,
                        "invalid_field",
                        f"state: {name[:40]!r} is not one of {', '.join(_STATES)}",
                        field="state",
                    )
                states.append(_STATES[name])
        limit = DEFAULT_PAGE
        if "limit" in query:
            text = query["limit"]
            if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_PAGE:
                raise ApiError(
                    422, "invalid_field", f"limit: must be an integer from 1 to {MAX_PAGE}", field="limit"
                )
            limit = int(text)
        after = query.get("after") or None
        if after is not None and not _REF.match(after):
            raise ApiError(422, "invalid_field", "after: not a job id from a previous page", field="after")
        try:
            items = await self.blocking(
                self.store.list_items, tenant=tenant, states=states, limit=limit + 1, after=after
            )
        except NotFound:
            raise ApiError(
                422, "invalid_field", "after: not a job id from a previous page", field="after"
            ) from None
        page = items[:limit]
        next_after = page[-1].id if len(items) > limit else None
        return web.json_response({"jobs": [jobs.project(item) for item in page], "next_after": next_after})

    # --- operations --------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        # Liveness: the event loop answers. Dependencies belong to readiness, not liveness.
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        checks: dict[str, str] = {}
        ready = True
        try:
            await asyncio.wait_for(self.blocking(self.store.now), timeout=5)
            checks["store"] = "ok"
        except Exception as exc:
            ready = False
            checks["store"] = type(exc).__name__
        try:
            depth = await asyncio.wait_for(self.blocking(self.transport.depth), timeout=5)
            checks["transport"] = "ok"
        except Exception as exc:
            ready = False
            depth = None
            checks["transport"] = type(exc).__name__
        body = {"status": "ready" if ready else "not_ready", "checks": checks, "depth": depth}
        return web.json_response(body, status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.settings))


GATEWAY: Final = web.AppKey("gateway", Gateway)


def _route_of(request: web.Request) -> str:
    info = request.match_info
    if info.http_exception is not None or info.route.resource is None:
        return "unmatched"
    return info.route.resource.canonical


@web.middleware
async def _errors_and_metrics(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    started = time.perf_counter()
    route = _route_of(request)
    try:
        response = await handler(request)
    except ApiError as exc:
        response = exc.response()
    except web.HTTPException as exc:
        # aiohttp's own answers (unknown route, wrong method, body over client_max_size) as JSON.
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            exc.status, "http_error"
        )
        headers = {k: v for k, v in exc.headers.items() if k.lower() in {"allow", "retry-after"}}
        response = ApiError(exc.status, code, exc.reason, headers=headers).response()
    except Exception:
        log.exception("unexpected gateway error", extra={"route": route, "method": request.method})
        response = ApiError(500, "internal", "unexpected error; see the gateway log").response()
    m.REQUESTS.labels(route, str(response.status)).inc()
    m.REQUEST_SECONDS.labels(route).observe(time.perf_counter() - started)
    return response


def create_app(
    settings: Settings,
    store: WorkItemStore,
    transport: Transport,
    signing_key: bytes,
    tokens: TokenRegistry,
) -> web.Application:
    gateway = Gateway(settings, store, transport, signing_key, tokens)
    # aiohttp refuses bodies past client_max_size itself; ours is a byte above the limit we check,
    # so a body exactly at the limit is read and anything larger is refused without buffering it.
    app = web.Application(middlewares=[_errors_and_metrics], client_max_size=gateway.body_limit + 1)
    app[GATEWAY] = gateway
    app.router.add_post("/api/turns", gateway.submit)
    app.router.add_post("/api/turns:batch", gateway.submit_batch)
    app.router.add_get("/api/graph/jobs", gateway.job_list)
    app.router.add_get("/api/graph/jobs/{job_id}", gateway.job_status)
    app.router.add_post("/api/graph/jobs/{job_id}/cancel", gateway.job_cancel)
    app.router.add_get("/healthz", gateway.healthz)
    app.router.add_get("/readyz", gateway.readyz)
    app.router.add_get("/metrics", gateway.metrics)
    app.router.add_get("/openapi.json", gateway.openapi)

    async def _shutdown(app: web.Application) -> None:
        gateway.pool.shutdown(wait=True, cancel_futures=True)

    app.on_cleanup.append(_shutdown)
    return app
