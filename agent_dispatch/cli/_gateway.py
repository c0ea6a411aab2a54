"""``agent-dispatch gateway``: serve the HTTP API until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "gateway",
        help="run the HTTP gateway",
        description="Serve the HTTP API (POST /api/turns, /api/graph/jobs, /metrics, /openapi.json). "
        "Needs AGENT_DISPATCH_TOKENS_FILE. Exit 0 after a clean stop, 1 when the schema needs "
        "`agent-dispatch migrate`, 2 for bad settings, 3 when the store or transport is unreachable, 130 after Ctrl-C.",
    )
    parser.add_argument("--host", help="listen address (default: AGENT_DISPATCH_GATEWAY_HOST, 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, help="listen port (default: AGENT_DISPATCH_GATEWAY_PORT, 8080; 0: any free port)"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from agent_dispatch.settings import load_or_exit

    # Settings first: a bad value must be the only line printed, before anything else starts.
    settings = load_or_exit("agent-dispatch gateway")
    from agent_dispatch import _logging
    from agent_dispatch.gateway import GatewayServer, StopSignals, open_components
    from agent_dispatch.runtime import EXIT_INTERRUPTED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, StartupError

    if args.port is not None and not 0 <= args.port <= 65535:
        print("agent-dispatch gateway: invalid option --port: allowed: 0 to 65535", file=sys.stderr)
        return EXIT_USAGE
    _logging.configure(settings.log_level, settings.log_format.value)
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
