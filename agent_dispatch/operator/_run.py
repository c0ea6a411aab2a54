"""``agent-dispatch operator`` / ``agent-dispatch-operator``: run kopf in this process.

Settings come from the settings module (log level and format, the metrics port), so a bad
variable stops the operator with exit code 2 like every other entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import kopf

from agent_dispatch import _logging
from agent_dispatch.settings import load_or_exit


def scope_of(namespaces: Sequence[str], all_namespaces: bool) -> tuple[bool, list[str]]:
    """(clusterwide, namespaces): with neither option the operator watches every namespace."""
    if all_namespaces or not namespaces:
        return True, []
    return False, list(namespaces)


def main(args: argparse.Namespace) -> int:
    settings = load_or_exit("agent-dispatch operator")
    _logging.configure(settings.log_level, settings.log_format.value)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port)
    from agent_dispatch.operator.handlers import REGISTRY

    clusterwide, namespaces = scope_of(args.namespace, args.all_namespaces)
    kopf.run(
        registry=REGISTRY,
        # Standalone: one replica (the chart's Deployment uses Recreate), so no peering objects
        # and no extra RBAC for kopf's peering resources.
        standalone=True,
        clusterwide=clusterwide,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(),
    )
    return 0


class OperatorThread(threading.Thread):
    """The operator in a background thread with its own event loop and a stop flag (for embedding
    and tests; production runs :func:`main` in its own process)."""

    def __init__(self, namespaces: Sequence[str], memo: Any | None = None) -> None:
        super().__init__(name="agent-dispatch-operator", daemon=True)
        self._namespaces = list(namespaces)
        self._memo = memo if memo is not None else kopf.Memo()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        from agent_dispatch.operator.handlers import REGISTRY

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        ready = asyncio.Event()

        async def _watch_ready() -> None:
            await ready.wait()
            self.ready.set()

        async def _main() -> None:
            watcher = asyncio.create_task(_watch_ready())
            try:
                await kopf.operator(
                    registry=REGISTRY,
                    standalone=True,
                    clusterwide=not self._namespaces,
                    namespaces=self._namespaces,
                    memo=self._memo,
                    stop_flag=self._stop,
                    ready_flag=ready,
                )
            finally:
                watcher.cancel()

        try:
            self._loop.run_until_complete(_main())
        finally:
            self._loop.close()

    def stop(self, timeout: float = 30) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self.join(timeout)
