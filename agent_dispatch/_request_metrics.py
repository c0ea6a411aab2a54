"""Request metrics of the project's aiohttp servers (the gateway and the external-metrics API): one
route label rule and one middleware that counts and times every request.

It sits below both servers (they are siblings that never import each other) and imports nothing
from the package, so either may use it.
"""

from __future__ import annotations

import time

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import Counter, Histogram


def route_of(request: web.Request) -> str:
    """The route template (``/api/graph/jobs/{job_id}``), never the raw path, so the number of
    series stays bounded whatever clients send; ``unmatched`` for an unknown path or method."""
    info = request.match_info
    if info.http_exception is not None or info.route.resource is None:
        return "unmatched"
    return info.route.resource.canonical


def observe_requests(requests: Counter, seconds: Histogram) -> Middleware:
    """A middleware that counts each request in ``requests`` (labels: route, status code) and
    times it in ``seconds`` (label: route).

    Put it first, outside any middleware that turns errors into answers, so it counts what is
    sent. An ``HTTPException`` a handler raises is counted with its status and passes on; any
    other exception is timed only and passes on to aiohttp.
    """

    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        route = route_of(request)
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            requests.labels(route, str(exc.status)).inc()
            raise
        finally:
            seconds.labels(route).observe(time.perf_counter() - started)
        requests.labels(route, str(response.status)).inc()
        return response

    return observe
