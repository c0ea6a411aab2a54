"""``agent-dispatch metrics-api``: serve ``external.metrics.k8s.io/v1beta1`` over HTTPS.

Startup reads the front proxy's contract from the ``extension-apiserver-authentication``
ConfigMap (and re-reads it every few minutes, so a rotated requestheader CA is trusted without a
restart), then serves TLS with the chart-managed certificate. No database credentials at all:
depths come from the AgentDispatch objects' ``.status``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
from typing import Any, Final

from aiohttp import web

from agent_dispatch import _logging
from agent_dispatch.k8s_client import new_api_client
from agent_dispatch.k8s_names import add_namespace_scope
from agent_dispatch.metrics_api import _api, _auth
from agent_dispatch.runtime import EXIT_UNAVAILABLE
from agent_dispatch.settings import load_or_exit

log = logging.getLogger("agent_dispatch.metrics_api")

AUTH_RELOAD_S: Final = 300.0
GAUGE_REFRESH_S: Final = 10.0


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "metrics-api", help="serve the external-metrics API (queue depth per AgentDispatch) for HPAs"
    )
    add_namespace_scope(
        parser,
        each="answer for AgentDispatch objects in this namespace (repeatable)",
        every="answer for every namespace (the default when no --namespace is given)",
    )
    parser.add_argument("--port", type=int, default=6443, help="HTTPS port (default 6443)")
    parser.add_argument("--tls-cert-file", default="/var/run/serving-cert/tls.crt")
    parser.add_argument("--tls-key-file", default="/var/run/serving-cert/tls.key")
    parser.add_argument(
        "--max-age-seconds",
        type=float,
        default=_api.DEFAULT_MAX_AGE_S,
        help="a queue depth older than this is an error, not a number (default 30)",
    )
    parser.set_defaults(handler=main)


def read_auth_config(api_client: Any) -> _auth.RequestHeaderConfig | None:
    from kubernetes import client

    cm = client.CoreV1Api(api_client).read_namespaced_config_map(
        _auth.AUTH_CONFIGMAP_NAME, _auth.AUTH_CONFIGMAP_NAMESPACE, _request_timeout=10
    )
    return _auth.requestheader_config(cm.data)


async def _reload_auth(
    api_client: Any, holder: dict[str, _auth.RequestHeaderConfig], context: ssl.SSLContext
) -> None:
    while True:
        await asyncio.sleep(AUTH_RELOAD_S)
        try:
            config = await asyncio.to_thread(read_auth_config, api_client)
        except Exception as exc:  # keep the last good contract
            log.warning("re-reading the front-proxy configuration failed", extra={"error": str(exc)[:300]})
            continue
        if config is not None and config != holder["config"]:
            # load_verify_locations adds: a rotated CA is trusted alongside the old one until restart.
            context.load_verify_locations(cadata=config.client_ca)
            holder["config"] = config
            log.info("front-proxy configuration reloaded")


async def serve(args: argparse.Namespace, api_client: Any, config: _auth.RequestHeaderConfig) -> None:
    # Imported here, not at module level: the CLI imports this module to register the command,
    # and _server's Prometheus metrics (the per-instance depth gauge among them) must not appear in
    # every other process's registry (a worker would export the depth series again).
    from agent_dispatch.metrics_api import _server

    context = _auth.server_context(args.tls_cert_file, args.tls_key_file, config.client_ca)
    holder = {"config": config}
    namespaces = None if args.all_namespaces or not args.namespace else frozenset(args.namespace)
    backend = _server.Backend(
        api_client=api_client,
        list_dispatches=_server.dispatch_lister(api_client),
        namespaces=namespaces,
        auth_config=lambda: holder["config"],
        max_age_s=args.max_age_seconds,
    )
    runner = web.AppRunner(_server.build_app(backend), access_log=None)
    await runner.setup()
    # Every interface: the aggregator reaches the pod through its Service (the pod IP).
    await web.TCPSite(runner, "0.0.0.0", args.port, ssl_context=context).start()  # noqa: S104
    log.info("metrics API serving", extra={"port": args.port, "namespaces": sorted(namespaces or ["*"])})
    scopes: list[str | None] = sorted(namespaces) if namespaces else [None]
    try:
        await asyncio.gather(
            _server.refresh_gauges(backend, scopes, GAUGE_REFRESH_S),
            _reload_auth(api_client, holder, context),
        )
    finally:
        await runner.cleanup()


def main(args: argparse.Namespace) -> int:
    settings = load_or_exit("agent-dispatch metrics-api")
    _logging.configure(settings.log_level, settings.log_format.value)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port)
    api_client = new_api_client()
    try:
        config = read_auth_config(api_client)
    except Exception as exc:
        log.error("cannot read the front-proxy configuration", extra={"error": str(exc)[:300]})
        return EXIT_UNAVAILABLE
    if config is None:
        log.error("the API server publishes no requestheader client CA: no front proxy to trust")
        return EXIT_UNAVAILABLE
    asyncio.run(serve(args, api_client, config))
    return 0
