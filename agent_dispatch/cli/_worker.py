"""``agent-dispatch worker`` / ``agent-dispatch-worker``."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "worker",
        help="run a worker (same as agent-dispatch-worker)",
        description="Claim deliveries, run turns under fenced leases, commit, acknowledge. "
        "Configured by environment variables (see the README); SIGTERM drains gracefully. Exit 0 "
        "after SIGTERM, 130 after Ctrl-C, 1 when the schema needs `agent-dispatch migrate`, 2 for "
        "bad settings, 3 when the store or transport is unreachable.",
    )
    parser.add_argument(
        "-c",
        "--concurrency",
        type=int,
        metavar="N",
        help="worker threads (default: AGENT_DISPATCH_CONCURRENCY)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from agent_dispatch import _logging
    from agent_dispatch.runtime import EXIT_USAGE
    from agent_dispatch.settings import load_or_exit

    settings = load_or_exit("agent-dispatch worker")
    if args.concurrency is not None and not 1 <= args.concurrency <= 256:
        print("agent-dispatch worker: invalid option --concurrency: allowed: 1 to 256", file=sys.stderr)
        return EXIT_USAGE
    _logging.configure(settings.log_level, settings.log_format.value)
    from agent_dispatch.worker import run_worker

    return run_worker(settings, concurrency=args.concurrency)
