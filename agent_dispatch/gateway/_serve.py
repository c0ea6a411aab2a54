"""Serving the gateway: in a background thread (``up``, tests) or in the foreground (``gateway``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from agent_dispatch.gateway._app import create_app
from agent_dispatch.gateway._auth import TokenRegistry
from agent_dispatch.runtime import Runtime

log = logging.getLogger("agent_dispatch.gateway")

#: In-flight requests get this long to finish when the gateway stops.
SHUTDOWN_TIMEOUT_S: Final = 10.0
START_TIMEOUT_S: Final = 30.0


@dataclass
class Components:
    """What a gateway serves over (a runtime and the tenants' tokens); the caller that opened
    them closes them."""

    runtime: Runtime
    tokens: TokenRegistry

    def close(self) -> None:
        self.runtime.close()


class GatewayServer:
    """The gateway on its own event loop in a daemon thread; ``url`` is known once ``start`` returns."""

    def __init__(
        self,
        components: Components,
        *,
        host: str,
        port: int,
        sock: socket.socket | None = None,
    ) -> None:
        """``sock``: an already bound listening socket to serve on (``up`` binds before it writes)."""
        self._sock = sock
        self._components = components
        self._host = host
        self._port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.port = port

    @property
    def url(self) -> str:
        host = self._host
        if host in {"0.0.0.0", "::", ""}:  # noqa: S104 - the listen address, shown as a reachable one
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def start(self) -> GatewayServer:
        self._thread = threading.Thread(target=self._serve, name="gateway", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise RuntimeError("the gateway did not start in time")
        if self._error is not None:
            self._thread.join(timeout=SHUTDOWN_TIMEOUT_S + 5)
            raise self._error
        return self

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._open())
        except BaseException as exc:
            self._error = exc
            # The app started before the bind failed (the UI's sampler and the thread pool run
            # store calls): stop it before the caller closes the store under them.
            with contextlib.suppress(Exception):
                loop.run_until_complete(self._close())
            loop.close()
            self._started.set()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._close())
            loop.close()

    async def _open(self) -> None:
        c = self._components
        app = create_app(c.runtime, c.tokens)
        # access_log off: request lines carry job ids per request; the metrics carry the counts.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self._runner.setup()
        site: web.BaseSite
        if self._sock is not None:
            site = web.SockSite(self._runner, self._sock)
        else:
            site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        # Port 0 asks the kernel for a free port; report the one actually bound.
        for address in self._runner.addresses:
            if isinstance(address, tuple):
                self.port = int(address[1])
                break

    async def _close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then return."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=SHUTDOWN_TIMEOUT_S + 5)


class StopSignals:
    """SIGINT and SIGTERM caught from entry (the main thread only) until exit.

    Entered before the process says it is serving, so a supervisor that stops it as soon as it
    reads that line never meets the default handler (which would end it with -15, unclean).
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._received: list[int] = []
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._received.append(signum)
        self._stop.set()

    def __enter__(self) -> StopSignals:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def wait(self) -> int:
        """Block until SIGINT or SIGTERM; return which one came first."""
        while not self._stop.wait(0.5):
            pass
        return self._received[0]
