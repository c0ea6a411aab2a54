"""``/metrics``, ``/healthz`` and ``/readyz`` on the worker's metrics port."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agent_dispatch.worker._loop import WorkerState


def serve(
    state: WorkerState,
    port: int,
    *,
    stale_after_s: float,
    host: str = "0.0.0.0",  # noqa: S104 - pods expose metrics to Prometheus
) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._reply(200, generate_latest(), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                # Alive while the claim loops keep turning (a wedged loop restarts the pod).
                alive = time.time() - state.last_loop_at < stale_after_s
                self._reply(200 if alive else 503, b"ok\n" if alive else b"claim loop stalled\n")
            elif self.path == "/readyz":
                self._reply(200 if state.ready else 503, b"ready\n" if state.ready else b"not ready\n")
            else:
                self._reply(404, b"not found\n")

        def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
