"""The idempotency contract through ``agent-dispatch submit`` (docs/gateway.md, "Idempotency and
refusals"), as a user runs it: a subprocess, through a gateway or straight into the store, on
SQLite, PostgreSQL and Kafka.

A refusal at the bound (exit 1) keeps nothing under the key, and the same command later is a
fresh attempt that creates the job the key names; a replay of an accepted key prints that job
with ``created: false`` even at the bound; the key with a different payload is refused (409,
exit 1) and changes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from agent_dispatch.models import deterministic_id
from tests.gateway._contract import TENANT, finish_one, job_ids, settings_env
from tests.gateway._harness import TOKENS, Running, running_gateway

pytestmark = pytest.mark.timeout(300)

BASE_ENV = {
    k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "TASK_QUEUE", "STATE_DB", "KAFKA_"))
}


def submit(env: dict[str, str], key: str, payload: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_dispatch.cli",
            "submit",
            "--kind",
            "t",
            "--payload",
            json.dumps(payload),
            "--idempotency-key",
            key,
            "--tenant",
            TENANT,  # used straight into the store; a gateway takes the tenant from the token
        ],
        env={**BASE_ENV, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def handle(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    answer: dict[str, Any] = json.loads(proc.stdout)
    return answer


@pytest.mark.parametrize("mode", ["gateway", "direct"])
def test_submit_keeps_the_contract(contract_settings: Any, mode: str) -> None:
    with running_gateway(contract_settings(max_depth=2)) as gw:
        env = cli_env(gw, mode)
        first = handle(submit(env, "a", {"n": "a"}))
        assert first["created"] is True and first["job_id"] == deterministic_id(TENANT, "a")
        handle(submit(env, "b", {"n": "b"}))

        refused = submit(env, "c", {"n": "c"})
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "429" in refused.stderr or "queue" in refused.stderr.lower(), refused.stderr
        job_c = deterministic_id(TENANT, "c")
        assert gw.call("GET", f"/api/graph/jobs/{job_c}").status == 404  # nothing under the key

        replay = handle(submit(env, "a", {"n": "a"}))  # at the bound: the job, not a refusal
        assert (replay["job_id"], replay["created"]) == (first["job_id"], False)
        changed = submit(env, "a", {"n": "not a"})
        assert changed.returncode == 1, changed.stdout + changed.stderr
        assert "409" in changed.stderr or "different" in changed.stderr.lower(), changed.stderr

        finish_one(gw)  # room comes back when a turn finishes
        retried = handle(submit(env, "c", {"n": "c"}))
        assert (retried["job_id"], retried["created"], retried["state"]) == (job_c, True, "ready")
        assert sorted(job_ids(gw)) == sorted({first["job_id"], deterministic_id(TENANT, "b"), job_c})


def cli_env(gw: Running, mode: str) -> dict[str, str]:
    if mode == "gateway":
        return {"AGENT_DISPATCH_GATEWAY_URL": gw.url, "AGENT_DISPATCH_TOKEN": TOKENS[TENANT]}
    return settings_env(gw.settings)
