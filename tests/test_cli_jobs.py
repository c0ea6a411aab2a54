"""`agent-dispatch submit`, `jobs` and `gateway` as a user runs them: subprocesses, exit codes, output."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch.gateway import hash_token, write_tokens_file
from tests.gateway._harness import SIGNING_KEY, TOKENS, Running, gateway_settings, running_gateway

pytestmark = pytest.mark.timeout(180)

BASE_ENV = {
    k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "TASK_QUEUE", "STATE_DB", "KAFKA_"))
}


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent_dispatch.cli", *args],
        env={**BASE_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def gw(tmp_path: Path) -> Iterator[Running]:
    with running_gateway(gateway_settings("sqlite", tmp_path / "gw", None)) as running:
        yield running


def remote(gw: Running, tenant: str = "tenant-a") -> dict[str, str]:
    return {"AGENT_DISPATCH_GATEWAY_URL": gw.url, "AGENT_DISPATCH_TOKEN": TOKENS[tenant]}


def test_submit_status_list_cancel_over_http(gw: Running) -> None:
    env = remote(gw)
    proc = cli("submit", "--kind", "report", "--payload", '{"n": 1}', "--session", "s-1", env=env)
    assert proc.returncode == 0, proc.stderr
    handle = json.loads(proc.stdout)
    assert handle["session_id"] == "s-1" and handle["state"] == "ready"
    assert gw.store.get(handle["job_id"]).tenant == "tenant-a"

    status = cli("jobs", "status", handle["job_id"], env=env)
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "ready"
    listing = cli("jobs", "list", env=env)
    assert listing.returncode == 0
    assert listing.stdout.splitlines()[0].split()[:2] == ["JOB", "STATE"]
    assert handle["job_id"] in listing.stdout
    cancelled = cli("jobs", "cancel", handle["job_id"], env=env)
    assert cancelled.returncode == 0 and json.loads(cancelled.stdout)["state"] == "cancelled"
    page = json.loads(cli("jobs", "list", "--state", "cancelled", "--json", env=env).stdout)
    assert [j["job_id"] for j in page["jobs"]] == [handle["job_id"]]

    # Another tenant's token cannot see it: exit 1, the gateway's 404.
    other = cli("jobs", "status", handle["job_id"], env=remote(gw, "tenant-b"))
    assert other.returncode == 1 and "HTTP 404" in other.stderr


def test_submit_exit_codes(gw: Running, tmp_path: Path) -> None:
    env = remote(gw)
    assert cli("submit", "--payload", "{not json", env=env).returncode == 2
    bad = cli("submit", "--kind", "bad kind", env=env)
    assert bad.returncode == 2 and "HTTP 422" in bad.stderr and "kind" in bad.stderr
    wrong = cli("submit", env={**env, "AGENT_DISPATCH_TOKEN": "x" * 20})
    assert wrong.returncode == 2 and "HTTP 401" in wrong.stderr
    down = cli("submit", "--url", f"http://127.0.0.1:{_free_port()}", env=env)
    assert down.returncode == 3 and "unreachable" in down.stderr
    payload = tmp_path / "payload.json"
    payload.write_text('{"from": "file"}')
    ok = cli("submit", "--payload", f"@{payload}", "--idempotency-key", "k-1", env=env)
    again = cli("submit", "--payload", f"@{payload}", "--idempotency-key", "k-1", env=env)
    assert json.loads(ok.stdout)["job_id"] == json.loads(again.stdout)["job_id"]
    assert json.loads(again.stdout)["created"] is False


def test_submit_directly_into_the_store_and_watch_it_finish(tmp_path: Path) -> None:
    from agent_dispatch.worker import build_worker

    data_dir = tmp_path / "direct"
    env = {"AGENT_DISPATCH_DATA_DIR": str(data_dir), "AGENT_DISPATCH_SIGNING_KEY": SIGNING_KEY}
    assert cli("migrate", env=env).returncode == 0
    ids = []
    for i in range(3):
        proc = cli("submit", "--kind", "t", "--payload", json.dumps({"i": i}), "--tenant", "team-x", env=env)
        assert proc.returncode == 0, proc.stderr
        ids.append(json.loads(proc.stdout)["job_id"])
    listing = json.loads(cli("jobs", "list", "--tenant", "team-x", "--json", env=env).stdout)
    assert sorted(j["job_id"] for j in listing["jobs"]) == sorted(ids)
    assert json.loads(cli("jobs", "list", "--json", env=env).stdout)["jobs"] == []  # tenant local has none

    settings = gateway_settings("sqlite", data_dir, None)
    worker = build_worker(settings)
    worker.start()
    try:
        watch = cli(
            "jobs", "watch", *ids, "--tenant", "team-x", "--interval", "0.1", "--timeout", "60", env=env
        )
    finally:
        worker.stop(grace_s=2)
        worker.transport.close()
        worker.store.close()
    assert watch.returncode == 0, watch.stdout + watch.stderr
    for job_id in ids:
        assert f"{job_id} succeeded" in watch.stdout
    assert watch.stdout.strip().splitlines()[-1] == "3 succeeded"


def test_submit_wait_prints_one_json_document(tmp_path: Path) -> None:
    """Scripts parse ``submit --wait``'s stdout: one document (the final status with the handle's
    fields), the wait itself reported on stderr."""
    from agent_dispatch.worker import build_worker

    data_dir = tmp_path / "direct"
    env = {"AGENT_DISPATCH_DATA_DIR": str(data_dir), "AGENT_DISPATCH_SIGNING_KEY": SIGNING_KEY}
    assert cli("migrate", env=env).returncode == 0
    worker = build_worker(gateway_settings("sqlite", data_dir, None))
    worker.start()
    try:
        proc = cli("submit", "--payload", '{"n": 1}', "--wait", "--timeout", "60", env=env)
    finally:
        worker.stop(grace_s=2)
        worker.transport.close()
        worker.store.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final = json.loads(proc.stdout)  # raises on a second document
    assert final["state"] == "succeeded" and final["created"] is True
    assert f"accepted job {final['job_id']}; waiting" in proc.stderr


def test_jobs_status_of_a_missing_job_is_1(tmp_path: Path) -> None:
    env = {"AGENT_DISPATCH_DATA_DIR": str(tmp_path), "AGENT_DISPATCH_SIGNING_KEY": SIGNING_KEY}
    assert cli("migrate", env=env).returncode == 0
    proc = cli("jobs", "status", "nope", env=env)
    assert proc.returncode == 1 and "no such job" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gateway_env(tmp_path: Path, **extra: Any) -> dict[str, str]:
    tokens = tmp_path / "tokens.yaml"
    write_tokens_file(tokens, {"tenant-a": [hash_token(TOKENS["tenant-a"])]})
    return {
        "AGENT_DISPATCH_DATA_DIR": str(tmp_path),
        "AGENT_DISPATCH_SIGNING_KEY": SIGNING_KEY,
        "AGENT_DISPATCH_TOKENS_FILE": str(tokens),
        **{k: str(v) for k, v in extra.items()},
    }


def test_gateway_command_needs_a_valid_tokens_file(tmp_path: Path) -> None:
    env = _gateway_env(tmp_path)
    assert cli("migrate", env=env).returncode == 0
    missing = cli("gateway", env={**env, "AGENT_DISPATCH_TOKENS_FILE": ""})
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith(
        "agent-dispatch gateway: invalid setting AGENT_DISPATCH_TOKENS_FILE"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenant-a: not-a-hash\n")
    invalid = cli("gateway", env={**env, "AGENT_DISPATCH_TOKENS_FILE": str(bad)})
    assert (
        invalid.returncode == 2
        and "64 hex" in invalid.stderr
        and len(invalid.stderr.strip().splitlines()) == 1
    )
    gone = cli("gateway", env={**env, "AGENT_DISPATCH_TOKENS_FILE": str(tmp_path / "absent.yaml")})
    assert gone.returncode == 2 and "cannot be read" in gone.stderr


def test_gateway_command_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    env = _gateway_env(tmp_path, AGENT_DISPATCH_GATEWAY_PORT=0)
    assert cli("migrate", env=env).returncode == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_dispatch.cli", "gateway"],
        env={**BASE_ENV, **env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("agent-dispatch gateway: serving on http://127.0.0.1:"), line
        url = line.split()[-1]
        submitted = cli(
            "submit", env={"AGENT_DISPATCH_GATEWAY_URL": url, "AGENT_DISPATCH_TOKEN": TOKENS["tenant-a"]}
        )
        assert submitted.returncode == 0, submitted.stderr
        # The port is taken now: a second gateway on it says so and exits 3.
        port = url.rsplit(":", 1)[1]
        clash = cli("gateway", env={**env, "AGENT_DISPATCH_GATEWAY_PORT": port})
        assert clash.returncode == 3 and f"cannot listen on port {port}" in clash.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


REPO = Path(__file__).resolve().parent.parent


def test_every_jobs_action_the_readme_names_exists() -> None:
    """A newcomer types what the README says: `jobs show ID` works, as does `jobs status ID`."""
    from agent_dispatch.cli import build_parser

    readme = (REPO / "README.md").read_text()
    named = set(re.findall(r"jobs (\w+)", readme)) | {"show", "status"}
    parser = build_parser()
    for action in sorted(named):
        parsed = None
        for argv in (["jobs", action, "job-1"], ["jobs", action]):
            try:
                parsed = parser.parse_args(argv)
                break
            except SystemExit:
                continue
        assert parsed is not None, f"README names `jobs {action}`, which is no subcommand"


def test_jobs_show_prints_the_status(gw: Running) -> None:
    submitted = cli("submit", env=remote(gw))
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job_id"]
    shown = cli("jobs", "show", job_id, env=remote(gw))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["job_id"] == job_id


def test_the_readme_says_where_run_sh_installs_the_command_line() -> None:
    """run.sh installs into .venv/bin (not on PATH): the README must say how to reach it."""
    script = (REPO / "scripts" / "run.sh").read_text()
    assert ".venv/bin/agent-dispatch" in script
    readme = (REPO / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert ".venv/bin/agent-dispatch submit" in quick_start
    assert "source .venv/bin/activate" in quick_start
