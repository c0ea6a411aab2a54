"""The aiohttp application: discovery, health, and the one metric, behind delegated auth.

Discovery and health documents are served to any caller that completes the TLS handshake: they
hold nothing but the group's name and the metric's name, and the aggregator's availability
check reads them without user headers. Metric values need an authenticated caller (the front
proxy, or a bearer token) that a SubjectAccessReview allows.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from aiohttp import web
from prometheus_client import Counter, Gauge, Histogram

from agent_dispatch import k8s_names
from agent_dispatch._request_metrics import observe_requests
from agent_dispatch.metrics_api import _api, _auth

log = logging.getLogger("agent_dispatch.metrics_api")

REQUESTS: Final = Counter(
    "agent_dispatch_metrics_api_requests",
    "Requests to the external-metrics API by route and HTTP status",
    ["route", "code"],
)
REQUEST_SECONDS: Final = Histogram(
    "agent_dispatch_metrics_api_request_seconds", "External-metrics API request duration", ["route"]
)
#: One series per AgentDispatch (never per pod), labelled with its namespace and the instance label
#: the worker ServiceMonitor also produces, so a Prometheus-based adapter selects it directly: named
#: as the external metric the HPA asks for, so the two names are one.
QUEUE_DEPTH: Final = Gauge(
    _api.METRIC,
    "Accepted, not yet acknowledged turns of one AgentDispatch (from its .status)",
    ["namespace", "agent_dispatch_io_instance"],
)
QUEUE_DEPTH_AGE: Final = Gauge(
    "agent_dispatch_queue_depth_age_seconds",
    "Age of the queue depth reading of one AgentDispatch",
    ["namespace", "agent_dispatch_io_instance"],
)

#: Lists the AgentDispatch objects of one namespace (blocking; run in a thread).
Lister = Callable[[str], list[dict[str, Any]]]


@dataclass
class Backend:
    """What the handlers need from the cluster, so the app is assembled in one place."""

    api_client: Any
    list_dispatches: Lister
    namespaces: frozenset[str] | None  # None: every namespace
    auth_config: Callable[[], _auth.RequestHeaderConfig]
    max_age_s: float = _api.DEFAULT_MAX_AGE_S
    ready: dict[str, bool] = field(default_factory=dict)


def _json(body: Mapping[str, Any], status: int = 200) -> web.Response:
    return web.json_response(dict(body), status=status)


def _error(code: int, reason: str, message: str) -> web.Response:
    return _json(_api.status(code, reason, message), code)


async def _authenticate(request: web.Request, backend: Backend) -> _auth.User:
    config = backend.auth_config()
    peercert = request.transport.get_extra_info("peercert") if request.transport else None
    user = _auth.front_proxy_user(config, peercert, request.headers)
    if user is not None:
        return user
    token = _auth.bearer_token(request.headers)
    if token is None:
        raise _auth.Unauthenticated("no front-proxy client certificate and no bearer token")
    return await asyncio.to_thread(_auth.token_review, backend.api_client, token)


def _selected(
    items: Sequence[Mapping[str, Any]],
    selector: Sequence[_api.Requirement],
    now: dt.datetime,
    max_age_s: float,
) -> list[_api.Reading]:
    return [
        _api.reading(obj, now, max_age_s)
        for obj in items
        if _api.selector_matches(selector, _api.instance_labels(obj))
    ]


def build_app(backend: Backend) -> web.Application:
    async def metric(request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["metric"]
        try:
            user = await _authenticate(request, backend)
        except _auth.Unauthenticated as exc:
            log.info("unauthenticated metric request", extra={"reason": str(exc), "namespace": namespace})
            return _error(401, "Unauthorized", f"Unauthorized: {exc}")
        allowed, reason = await asyncio.to_thread(
            _auth.access_review, backend.api_client, user, namespace, name
        )
        if not allowed:
            log.info(
                "metric request denied", extra={"user": user.name, "namespace": namespace, "metric": name}
            )
            message = (
                f'{name} is forbidden: User "{user.name}" cannot list resource "{name}" in API group '
                f'"{_api.GROUP}" in the namespace "{namespace}"' + (f": {reason}" if reason else "")
            )
            return _error(403, "Forbidden", message)
        if name not in _api.METRICS:
            return _json(_api.metric_not_found(name, namespace), 404)
        try:
            selector = _api.parse_selector(request.query.get("labelSelector", ""))
        except _api.SelectorError as exc:
            return _error(400, "BadRequest", str(exc))
        if backend.namespaces is not None and namespace not in backend.namespaces:
            # Not a namespace this server watches: nothing there can match (the API's empty list).
            return _json(_api.value_list([], name))
        try:
            items = await asyncio.to_thread(backend.list_dispatches, namespace)
        except Exception as exc:  # the API server is down or denies the list: no number to give
            log.warning(
                "listing AgentDispatches failed", extra={"namespace": namespace, "error": str(exc)[:300]}
            )
            return _error(503, "ServiceUnavailable", f"cannot list AgentDispatch objects in {namespace}")
        readings = _selected(items, selector, dt.datetime.now(dt.UTC), backend.max_age_s)
        problems = [r.problem for r in readings if r.problem]
        if problems:
            # An error, not a number: the HPA keeps its replica count until the depth is fresh again.
            return _error(503, "ServiceUnavailable", "; ".join(problems))
        return _json(_api.value_list(readings, name))

    async def document(body: Mapping[str, Any]) -> web.Response:
        return _json(body)

    def static(body: Mapping[str, Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(_request: web.Request) -> web.Response:
            return await document(body)

        return handler

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_request: web.Request) -> web.Response:
        if backend.ready.get("listed"):
            return web.Response(text="ok")
        return web.Response(status=503, text="AgentDispatch objects not listed yet")

    app = web.Application(middlewares=[observe_requests(REQUESTS, REQUEST_SECONDS)])
    app.router.add_get("/apis", static(_api.api_group_list()))
    app.router.add_get(f"/apis/{_api.GROUP}", static(_api.api_group()))
    app.router.add_get(f"/apis/{_api.GROUP_VERSION}", static(_api.api_resource_list()))
    app.router.add_get(f"/apis/{_api.GROUP_VERSION}/namespaces/{{namespace}}/{{metric}}", metric)
    app.router.add_get("/openapi/v2", static(_api.openapi_v2()))
    app.router.add_get("/openapi/v3", static(_api.openapi_v3()))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def export_depths(
    items: Sequence[Mapping[str, Any]], now: dt.datetime, known: set[tuple[str, str]]
) -> set[tuple[str, str]]:
    """Set the per-instance gauges from a listing; remove series of instances that went away.
    Returns the (namespace, instance) pairs now exported."""
    current: set[tuple[str, str]] = set()
    for obj in items:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        found = _api.reading(obj, now, float("inf"))
        if found.depth is None or found.observed is None:
            continue
        current.add(key)
        QUEUE_DEPTH.labels(*key).set(found.depth)
        QUEUE_DEPTH_AGE.labels(*key).set(max(0.0, (now - found.observed).total_seconds()))
    for key in known - current:
        QUEUE_DEPTH.remove(*key)
        QUEUE_DEPTH_AGE.remove(*key)
    return current


async def refresh_gauges(backend: Backend, namespaces: Sequence[str | None], interval_s: float) -> None:
    """Keep the Prometheus series (one per AgentDispatch) and readiness current."""
    known: set[tuple[str, str]] = set()
    while True:
        try:
            items: list[dict[str, Any]] = []
            for namespace in namespaces:
                items += await asyncio.to_thread(backend.list_dispatches, namespace or "")
            known = export_depths(items, dt.datetime.now(dt.UTC), known)
            backend.ready["listed"] = True
        except Exception as exc:  # keep serving; the next pass retries
            log.warning("refreshing queue depth gauges failed", extra={"error": str(exc)[:300]})
        await asyncio.sleep(interval_s)


def dispatch_lister(api_client: Any) -> Lister:
    """List AgentDispatch objects in a namespace ('' lists every namespace)."""
    from kubernetes import client

    api = client.CustomObjectsApi(api_client)

    def list_dispatches(namespace: str) -> list[dict[str, Any]]:
        if namespace:
            found = api.list_namespaced_custom_object(
                k8s_names.GROUP, k8s_names.VERSION, namespace, k8s_names.PLURAL, _request_timeout=10
            )
        else:
            found = api.list_cluster_custom_object(
                k8s_names.GROUP, k8s_names.VERSION, k8s_names.PLURAL, _request_timeout=10
            )
        return list(found.get("items", []))

    return list_dispatches
