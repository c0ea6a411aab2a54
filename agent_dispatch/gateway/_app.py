"""The gateway's aiohttp application: admission over HTTP, job status and cancellation.

It never runs a turn. Handlers are thin: they authenticate the bearer token, read the body within
its bound and hand the request to :class:`agent_dispatch.gateway.service.JobService` (shared with
the CLI's direct client) on a bounded thread pool, since store and transport calls block; the
event loop only moves bytes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, ParamSpec, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agent_dispatch._request_metrics import observe_requests, route_of
from agent_dispatch.gateway import _metrics as m
from agent_dispatch.gateway import ui
from agent_dispatch.gateway._auth import TokenRegistry
from agent_dispatch.gateway._coalesce import Coalescer, SubmitCoalescer
from agent_dispatch.gateway._models import Answer, JobHandle
from agent_dispatch.gateway._openapi import openapi_document
from agent_dispatch.gateway.service import JobService, ServiceError, admission_result, view_json
from agent_dispatch.models import WorkItem
from agent_dispatch.runtime import Runtime
from agent_dispatch.settings import IO_THREADS, Settings
from agent_dispatch.store import WorkItemStore
from agent_dispatch.transport import Transport

log = logging.getLogger("agent_dispatch.gateway")

P = ParamSpec("P")
R = TypeVar("R")

THREADS: Final = IO_THREADS
#: Bodies up to this size are validated on the event loop (tens of microseconds, less than a
#: thread hop); larger ones in the thread pool.
INLINE_PARSE_BYTES: Final = 16 * 1024

#: The gateway's error answers are the service's refusals (the old name is kept for importers).
ApiError = ServiceError


def error_response(error: ServiceError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


def answer(
    body: Answer | bytes, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """An answer model as the JSON response, serialised by pydantic's compiled serialiser (in one
    step: no intermediate dict, no second encoder); or an answer already serialised."""
    data = body if isinstance(body, bytes) else body.json_bytes()
    return web.Response(body=data, status=status, headers=headers, content_type="application/json")


def job_handle(item: WorkItem, *, created: bool) -> dict[str, Any]:
    return JobHandle.of(item, created=created).body()


@dataclass
class Gateway:
    """The handlers over one runtime: its store, its transport and its admission strategy (chosen
    once by the runtime, on the first submission), so the gateway never picks a strategy itself."""

    runtime: Runtime
    tokens: TokenRegistry
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="gateway-io")
    )
    service: JobService = field(init=False)
    coalescer: SubmitCoalescer = field(init=False)
    reads: Coalescer[tuple[str, str], WorkItem | ServiceError] = field(init=False)

    def __post_init__(self) -> None:
        self.service = JobService(self.settings, self.store, lambda: self.runtime.admission)
        self.coalescer = SubmitCoalescer(
            lambda requests: self.blocking(self.service.admit_many, requests),
            observe_size=m.SUBMIT_BATCH_SIZE.observe,
        )
        self.reads = Coalescer(
            lambda asks: self.blocking(self.service.status_many, asks),
            observe_size=m.STATUS_READ_BATCH_SIZE.observe,
        )

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def store(self) -> WorkItemStore:
        return self.runtime.store

    @property
    def transport(self) -> Transport:
        return self.runtime.transport

    async def blocking(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    # --- request plumbing ----------------------------------------------------------------------

    def tenant_of(self, request: web.Request) -> str:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        challenge = 'Bearer realm="agent-dispatch"'
        if scheme.lower() != "bearer" or not token.strip():
            raise ServiceError(
                401, "unauthenticated", "a bearer token is required", headers={"WWW-Authenticate": challenge}
            )
        tenant = self.tokens.authenticate(token.strip())
        if tenant is None:
            raise ServiceError(
                401,
                "invalid_token",
                "the bearer token is not valid",
                headers={"WWW-Authenticate": f'{challenge}, error="invalid_token"'},
            )
        return tenant

    async def read_body(self, request: web.Request) -> bytes:
        limit = self.service.body_limit
        too_large = ServiceError(
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

    # --- turns -------------------------------------------------------------------------------

    async def submit(self, request: web.Request) -> web.Response:
        tenant = self.tenant_of(request)
        key = request.headers.get("Idempotency-Key")
        try:
            body = await self.read_body(request)
            if len(body) <= INLINE_PARSE_BYTES:
                turn = self.service.prepare(tenant, body, idempotency_key=key)
            else:  # a large body would hold the event loop while it is parsed
                turn = await self.blocking(self.service.prepare, tenant, body, idempotency_key=key)
            handle = self.service.answer(await self.coalescer.run(turn))
        except ServiceError as exc:
            m.ADMISSIONS.labels(admission_result(exc)).inc()
            raise
        m.ADMISSIONS.labels("accepted" if handle.created else "duplicate").inc()
        return answer(handle, status=202, headers={"Location": handle.status_url})

    async def submit_batch(self, request: web.Request) -> web.Response:
        tenant = self.tenant_of(request)
        key = request.headers.get("Idempotency-Key")
        body = await self.read_body(request)
        result = await self.blocking(self.service.submit_batch, tenant, body, idempotency_key=key)
        for item in result.results:
            if item.status == 202:
                m.ADMISSIONS.labels("accepted" if item.created else "duplicate").inc()
            else:
                error = ServiceError(item.status, item.error or "", item.detail or "")
                m.ADMISSIONS.labels(admission_result(error)).inc()
        return answer(result)

    # --- jobs --------------------------------------------------------------------------------

    async def job_status(self, request: web.Request) -> web.Response:
        tenant = self.tenant_of(request)
        found = await self.reads.run((tenant, request.match_info["job_id"]))
        if isinstance(found, ServiceError):
            raise found
        return answer(view_json(found))

    async def job_cancel(self, request: web.Request) -> web.Response:
        tenant = self.tenant_of(request)
        view = await self.blocking(self.service.cancel, tenant, request.match_info["job_id"])
        return answer(view)

    async def job_list(self, request: web.Request) -> web.Response:
        tenant = self.tenant_of(request)
        query = request.query
        page = await self.blocking(
            self.service.list,
            tenant,
            states=query.getall("state", []),
            limit=query.get("limit"),
            after=query.get("after"),
        )
        return answer(page)

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


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as a JSON answer (inside the request metrics, so they count what is sent)."""
    try:
        return await handler(request)
    except ServiceError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        # aiohttp's own answers (unknown route, wrong method, body over client_max_size) as JSON.
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            exc.status, "http_error"
        )
        headers = {k: v for k, v in exc.headers.items() if k.lower() in {"allow", "retry-after"}}
        return error_response(ServiceError(exc.status, code, exc.reason, headers=headers))
    except Exception:
        log.exception(
            "unexpected gateway error", extra={"route": route_of(request), "method": request.method}
        )
        return error_response(ServiceError(500, "internal", "unexpected error; see the gateway log"))


def create_app(runtime: Runtime, tokens: TokenRegistry) -> web.Application:
    gateway = Gateway(runtime, tokens)
    # aiohttp refuses bodies past client_max_size itself; ours is a byte above the limit we check,
    # so a body exactly at the limit is read and anything larger is refused without buffering it.
    app = web.Application(
        middlewares=[observe_requests(m.REQUESTS, m.REQUEST_SECONDS), _errors],
        client_max_size=gateway.service.body_limit + 1,
    )
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
    ui.install(app, gateway)

    async def _shutdown(app: web.Application) -> None:
        gateway.pool.shutdown(wait=True, cancel_futures=True)

    app.on_cleanup.append(_shutdown)
    return app
