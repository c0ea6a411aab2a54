"""The gateway benchmark's ceiling: ``python -m bench._bare_gateway``.

An aiohttp server with the gateway's routes whose handlers only read and validate the same bodies
with the gateway's own models, and answer bodies of the same shape, storing nothing. Its rate is
what HTTP plus parsing costs on this machine; the gateway's rate is read as a ratio against it.
"""

from __future__ import annotations

import socket
import sys
import uuid

from aiohttp import web

from agent_dispatch.gateway._models import BatchBody, BatchTurnBody, TurnBody

_ID = str(uuid.uuid4())
_HANDLE = {
    "job_id": _ID,
    "work_item_id": _ID,
    "session_id": _ID,
    "state": "ready",
    "status_url": f"/api/graph/jobs/{_ID}",
    "created": True,
}
_STAMP = "2026-01-01T00:00:00.000000+00:00"
_VIEW = {
    "job_id": _ID,
    "tenant": "bench",
    "kind": "bench.noop",
    "queue": "default",
    "session_id": _ID,
    "state": "ready",
    "terminal": False,
    "attempt": 0,
    "max_attempts": 3,
    "lease_epoch": 0,
    "fencing_token": 0,
    "lease_owner": None,
    "priority": 0,
    "depends_on": [],
    "timestamps": {
        "created_at": _STAMP,
        "updated_at": _STAMP,
        "deadline": None,
        "lease_expires_at": None,
        "not_before": None,
    },
    "outcome": None,
    "error": None,
}


async def submit(request: web.Request) -> web.Response:
    TurnBody.model_validate_json(await request.read())
    return web.json_response(_HANDLE, status=202)


async def submit_batch(request: web.Request) -> web.Response:
    batch = BatchBody.model_validate_json(await request.read())
    results = []
    for index, raw in enumerate(batch.turns):
        BatchTurnBody.model_validate(raw)
        results.append({"index": index, "status": 202, **_HANDLE})
    return web.json_response({"results": results})


async def status(request: web.Request) -> web.Response:
    return web.json_response(_VIEW | {"job_id": request.match_info["job_id"]})


def main() -> int:
    app = web.Application()
    app.router.add_post("/api/turns", submit)
    app.router.add_post("/api/turns:batch", submit_batch)
    app.router.add_get("/api/graph/jobs/{job_id}", status)
    sock = socket.create_server(("127.0.0.1", 0))
    print(f"bare gateway: serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    web.run_app(app, sock=sock, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
