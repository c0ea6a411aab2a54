"""An executor plugin (``tests.e2e.recording:run``) for worker processes under test.

It optionally sleeps (``{"sleep_s": n}`` in the payload, noticing a lost lease at once), records
when it starts and ends in ``$AGENT_DISPATCH_TEST_TIMELINE`` (for session-overlap checks), then
posts its one side effect to the fencing sink through ``lease_guard.side_effect``.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.request

from agent_dispatch.envelope import AgentTurnEnvelope
from agent_dispatch.lease import WorkItemLeaseGuard
from agent_dispatch.worker import TurnFailed

SINK_URL = os.environ.get("AGENT_DISPATCH_TEST_SINK", "")
TIMELINE = os.environ.get("AGENT_DISPATCH_TEST_TIMELINE", "")


def _mark(event: str, env: AgentTurnEnvelope) -> None:
    if TIMELINE:
        with open(TIMELINE, "a") as out:
            out.write(
                json.dumps({"e": event, "job": env.job_id, "session": env.session_id, "t": time.time()})
                + "\n"
            )


def run(env: AgentTurnEnvelope, payload: bytes, guard: WorkItemLeaseGuard, log: logging.Logger) -> None:
    body = json.loads(payload or b"{}")
    _mark("start", env)
    deadline = time.monotonic() + float(body.get("sleep_s", 0))
    while (left := deadline - time.monotonic()) > 0:
        if guard.lost.wait(min(left, 0.05)):
            guard.check()

    def post() -> int:
        request = urllib.request.Request(
            SINK_URL,
            data=b"{}",
            method="POST",
            headers={
                "X-Agent-Dispatch-Job-Id": env.job_id,
                "X-Agent-Dispatch-Fencing-Token": str(guard.fencing_token),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    status = guard.side_effect(post)
    _mark("end", env)
    if status != 200:
        raise TurnFailed(f"sink refused the effect: HTTP {status}", retryable=False)
