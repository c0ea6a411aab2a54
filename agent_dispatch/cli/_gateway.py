"""``agent-dispatch gateway``: serve the HTTP API until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from agent_dispatch.cli._start import add_serving_command
from agent_dispatch.settings import Settings


def register(sub: Any) -> None:
    add_serving_command(
        sub,
        "gateway",
        serve,
        summary="run the HTTP gateway",
        description="Serve the HTTP API (POST /api/turns, /api/graph/jobs, /metrics, /openapi.json). "
        "Needs AGENT_DISPATCH_TOKENS_FILE. Exit 0 after a clean stop, 1 when the schema needs "
        "`agent-dispatch migrate`, 2 for bad settings, 3 when the store or transport is unreachable, 130 after Ctrl-C.",
        listen=True,
    )


def serve(args: argparse.Namespace, settings: Settings) -> int:
    from agent_dispatch.gateway import GatewayServer, StopSignals, open_components
    from agent_dispatch.runtime import EXIT_INTERRUPTED, EXIT_OK, EXIT_UNAVAILABLE, StartupError

    try:
        components = open_components(settings)
    except StartupError as exc:
        print(f"agent-dispatch gateway: {exc}", file=sys.stderr)
        return exc.exit_code
    host = args.host or settings.gateway_host
    port = settings.gateway_port if args.port is None else args.port
    server = GatewayServer(components, host=host, port=port)
    try:
        server.start()
    except OSError as exc:
        components.close()
        print(f"agent-dispatch gateway: cannot listen on port {port}: {exc.strerror}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        with StopSignals() as signals:
            print(f"agent-dispatch gateway: serving on {server.url}", flush=True)
            received = signals.wait()
    finally:
        server.stop()
        components.close()
    # SIGTERM is how a pod is told to stop (a clean stop); Ctrl-C is an interruption.
    return EXIT_INTERRUPTED if received == signal.SIGINT else EXIT_OK
