"""The web UI's handlers, its security headers and the overview's sampling task."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from agent_dispatch.gateway.insight import InsightService, Scope
from agent_dispatch.gateway.service import ServiceError
from agent_dispatch.gateway.ui import _html, _views
from agent_dispatch.gateway.ui._heartbeats import Heartbeats
from agent_dispatch.gateway.ui._session import COOKIE, LIFETIME_S, Session, Sessions

if TYPE_CHECKING:
    from agent_dispatch.gateway._app import Gateway

log = logging.getLogger("agent_dispatch.gateway")

STATIC: Final = Path(__file__).parent / "static"
POLL_S: Final = 2.0
CSP: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    # same-origin, not no-referrer: with no-referrer Chromium sends "Origin: null" on our own form
    # posts, and the same-origin check below could not tell them from a foreign page.
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
}
JOB_FILTERS: Final = ("state", "kind", "session", "tenant", "limit", "after")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class UI:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        runtime = gateway.runtime
        self.insight = InsightService(
            gateway.service,
            lambda: runtime.transport,
            runtime.signing_key,
            heartbeats=Heartbeats(gateway.service.settings).read,
        )
        self.sessions = Sessions(runtime.signing_key, gateway.tokens)
        self._task: asyncio.Task[None] | None = None

    # --- plumbing --------------------------------------------------------------------------------

    def session(self, request: web.Request) -> Session | None:
        return self.sessions.read(request.cookies.get(COOKIE))

    def html(self, text: str, status: int = 200) -> web.Response:
        return web.Response(
            text=text, status=status, content_type="text/html", headers={"Cache-Control": "no-store"}
        )

    def page(self, render: Callable[[web.Request, Session], Awaitable[web.Response]]) -> Handler:
        """A signed-in page: the sign-in form without a session, an HTML error page for a refusal."""

        async def handler(request: web.Request) -> web.StreamResponse:
            session = self.session(request)
            if session is None:
                return see_other("/ui/login")
            try:
                return await render(request, session)
            except ServiceError as exc:
                return self.html(
                    _html.error_page(exc.status, exc.detail, who=_who(session), csrf=session.csrf), exc.status
                )

        return handler

    def api(self, produce: Callable[[web.Request, Session], Awaitable[dict[str, Any]]]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            session = self.session(request)
            if session is None:
                raise ServiceError(401, "unauthenticated", "sign in at /ui/login")
            return web.json_response(await produce(request, session), headers={"Cache-Control": "no-store"})

        return handler

    def action(self, act: Callable[[Scope, str], Any]) -> Handler:
        """A state-changing form post: same origin, a session, and that session's CSRF token."""

        async def handler(request: web.Request) -> web.StreamResponse:
            session = self.session(request)
            if session is None:
                return see_other("/ui/login")
            form = await request.post()
            if not _same_origin(request) or not Sessions.csrf_ok(
                session, request.headers.get("X-CSRF-Token") or str(form.get("csrf", ""))
            ):
                return self.html(
                    _html.error_page(
                        403,
                        "the form is stale or not from this site; reload and retry",
                        who=_who(session),
                        csrf=session.csrf,
                    ),
                    403,
                )
            job_id = request.match_info["job_id"]
            try:
                await self.gw.blocking(act, session.scope, job_id)
            except ServiceError as exc:
                refused = self.html(
                    _html.error_page(exc.status, exc.detail, who=_who(session), csrf=session.csrf), exc.status
                )
                # A retry refused at the queue's bound (429) says when to try again, as the API does.
                refused.headers.update({k: v for k, v in exc.headers.items() if k.lower() == "retry-after"})
                return refused
            return see_other(f"/ui/jobs/{job_id}")

        return handler

    # --- sign in and out --------------------------------------------------------------------------

    async def login_form(self, request: web.Request) -> web.Response:
        return self.html(_html.login())

    async def login(self, request: web.Request) -> web.StreamResponse:
        if not _same_origin(request):
            return self.html(_html.login("the form is not from this site"), 403)
        form = await request.post()
        token = str(form.get("token", "")).strip()
        cookie = self.sessions.open(token) if token else None
        if cookie is None:
            return self.html(_html.login("That token is not valid."), 401)
        response = see_other("/ui/")
        response.set_cookie(
            COOKIE,
            cookie,
            max_age=LIFETIME_S,
            path="/ui",
            httponly=True,
            samesite="Strict",
            secure=request.secure,
        )
        return response

    async def logout(self, request: web.Request) -> web.StreamResponse:
        session = self.session(request)
        form = await request.post()
        if session is not None and not Sessions.csrf_ok(session, str(form.get("csrf", ""))):
            return self.html(_html.error_page(403, "the form is stale; reload and retry"), 403)
        response = see_other("/ui/login")
        response.del_cookie(COOKIE, path="/ui")
        return response

    # --- pages and their data --------------------------------------------------------------------

    async def overview_data(self, request: web.Request, session: Session) -> dict[str, Any]:
        return _views.overview(await self.gw.blocking(self.insight.overview, session.scope))

    async def tenants_data(self, request: web.Request, session: Session) -> dict[str, Any]:
        q = request.query
        page = await self.gw.blocking(
            self.insight.tenants, session.scope, after=q.get("after", ""), limit=q.get("limit") or None
        )
        return _views.tenants(page, q.get("limit", "")[:10])

    async def jobs_data(self, request: web.Request, session: Session) -> dict[str, Any]:
        query = _job_query(request)
        page = await self.gw.blocking(self.insight.list, session.scope, **query)
        return _views.jobs(page, {k: v for k, v in query.items() if k != "after"})

    async def job_data(self, request: web.Request, session: Session) -> dict[str, Any]:
        return _views.job(
            await self.gw.blocking(self.insight.job, session.scope, request.match_info["job_id"])
        )

    async def overview(self, request: web.Request, session: Session) -> web.Response:
        model = await self.overview_data(request, session)
        return self._render("Overview", _html.overview(model), session, "/ui/api/overview", "overview")

    async def tenants(self, request: web.Request, session: Session) -> web.Response:
        model = await self.tenants_data(request, session)
        return self._render("Tenants", _html.tenants(model), session, "/ui/api/tenants", "tenants")

    async def jobs(self, request: web.Request, session: Session) -> web.Response:
        model = await self.jobs_data(request, session)
        body = _html.jobs(model, _job_query(request), admin=session.scope.admin)
        return self._render("Jobs", body, session, "/ui/api/jobs", "jobs")

    async def job(self, request: web.Request, session: Session) -> web.Response:
        job_id = request.match_info["job_id"]
        model = await self.job_data(request, session)
        live = f"/ui/api/jobs/{job_id}"
        return self._render("Job", _html.job(model, job_id, session.csrf), session, live, "job")

    def _render(self, title: str, body: str, session: Session, live: str, kind: str) -> web.Response:
        return self.html(_html.page(title, body, who=_who(session), csrf=session.csrf, live=live, kind=kind))

    # --- the overview's sampler --------------------------------------------------------------------

    async def start_sampling(self, app: web.Application) -> None:
        self._task = asyncio.create_task(self._sample_forever())

    async def stop_sampling(self, app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _sample_forever(self) -> None:
        sampler = self.insight.sampler
        while True:
            try:
                await self.gw.blocking(sampler.sample)
            except Exception as exc:  # a store outage must not end sampling for good
                log.warning("web UI sampler: %s", type(exc).__name__)
            await asyncio.sleep(sampler.interval_s)


def _who(session: Session) -> str:
    return (
        f"{session.scope.name} (administrator: every tenant)" if session.scope.admin else session.scope.name
    )


def _same_origin(request: web.Request) -> bool:
    origin = request.headers.get("Origin")
    return origin is None or origin == f"{request.scheme}://{request.host}"


def _job_query(request: web.Request) -> dict[str, str]:
    return {
        k: request.query.get(k, "").strip()[:200] for k in JOB_FILTERS if request.query.get(k, "").strip()
    }


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    if request.path.startswith("/ui"):
        response.headers.update(SECURITY_HEADERS)


def install(app: web.Application, gateway: Gateway) -> None:
    """Mount the UI on the gateway's application (before the gateway's own cleanup is added)."""
    ui = UI(gateway)
    r = app.router
    r.add_get("/ui", _to_ui_root)
    r.add_get("/ui/", ui.page(ui.overview))
    r.add_get("/ui/login", ui.login_form)
    r.add_post("/ui/login", ui.login)
    r.add_post("/ui/logout", ui.logout)
    r.add_get("/ui/tenants", ui.page(ui.tenants))
    r.add_get("/ui/jobs", ui.page(ui.jobs))
    r.add_get("/ui/jobs/{job_id}", ui.page(ui.job))
    r.add_post("/ui/jobs/{job_id}/cancel", ui.action(ui.insight.cancel))
    r.add_post("/ui/jobs/{job_id}/retry", ui.action(ui.insight.retry))
    r.add_get("/ui/api/overview", ui.api(ui.overview_data))
    r.add_get("/ui/api/tenants", ui.api(ui.tenants_data))
    r.add_get("/ui/api/jobs", ui.api(ui.jobs_data))
    r.add_get("/ui/api/jobs/{job_id}", ui.api(ui.job_data))
    r.add_static("/ui/static", STATIC, append_version=False)
    app.on_response_prepare.append(_security_headers)
    app.on_startup.append(ui.start_sampling)
    app.on_cleanup.append(ui.stop_sampling)


async def _to_ui_root(request: web.Request) -> web.StreamResponse:
    # aiohttp deprecates plain-function handlers: this one only redirects "/ui" to "/ui/".
    return see_other("/ui/")


def see_other(location: str) -> web.Response:
    # Returned, not raised: the gateway's error middleware turns raised HTTP exceptions into JSON.
    return web.Response(status=303, headers={"Location": location})
