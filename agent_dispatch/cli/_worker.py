"""``agent-dispatch worker`` / ``agent-dispatch-worker``."""

from __future__ import annotations

import argparse
from typing import Any

from agent_dispatch.cli._start import add_serving_command
from agent_dispatch.settings import Settings


def register(sub: Any) -> None:
    add_serving_command(
        sub,
        "worker",
        serve,
        summary="run a worker (same as agent-dispatch-worker)",
        description="Claim deliveries, run turns under fenced leases, commit, acknowledge. "
        "Configured by environment variables (see the README); SIGTERM drains gracefully. Exit 0 "
        "after SIGTERM, 130 after Ctrl-C, 1 when the schema needs `agent-dispatch migrate`, 2 for "
        "bad settings, 3 when the store or transport is unreachable.",
        concurrency=True,
    )


def serve(args: argparse.Namespace, settings: Settings) -> int:
    from agent_dispatch.worker import run_worker

    return run_worker(settings, concurrency=args.concurrency)
