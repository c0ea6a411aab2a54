"""A downstream service that keeps the highest fencing token per item and refuses lower ones.

Workers reach it through ``lease_guard.side_effect``; it is how a real downstream protects itself
from stale writers, and it lets tests count accepted and refused effects per WorkItem.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FencingSink:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.highest: dict[str, int] = {}
        self.accepted: dict[str, list[int]] = defaultdict(list)
        self.refused: dict[str, list[int]] = defaultdict(list)
        self._server: ThreadingHTTPServer | None = None

    def offer(self, job_id: str, token: int) -> bool:
        with self.lock:
            if token < self.highest.get(job_id, 0):
                self.refused[job_id].append(token)
                return False
            self.highest[job_id] = token
            self.accepted[job_id].append(token)
            return True

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/effect"

    def start(self) -> FencingSink:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                self.rfile.read(length)
                job_id = self.headers["X-Agent-Dispatch-Job-Id"]
                token = int(self.headers["X-Agent-Dispatch-Fencing-Token"])
                ok = sink.offer(job_id, token)
                body = json.dumps({"accepted": ok}).encode()
                self.send_response(200 if ok else 409)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
