"""The README's main job: `agent-dispatch up` from an empty data directory, then a turn via curl."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(1200)

BASE_ENV = {
    k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "TASK_QUEUE", "STATE_DB", "KAFKA_"))
}


def _install_curl() -> str | None:
    """curl as a newcomer would use it; installed with the system's package manager if missing."""
    if shutil.which("curl") is None and shutil.which("apt-get") is not None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "curl"]):
            subprocess.run(cmd, env=env, capture_output=True, timeout=300, check=False)
    return shutil.which("curl")


@pytest.fixture(scope="module")
def curl() -> str | None:
    return _install_curl()


def http(curl: str | None, method: str, url: str, token: str, body: Any = None) -> dict[str, Any]:
    """One request, with curl when it is installed (the README's way), else with urllib."""
    data = None if body is None else json.dumps(body)
    if curl is not None:
        cmd = [curl, "-sS", "--fail-with-body", "-X", method, url, "-H", f"Authorization: Bearer {token}"]
        if data is not None:
            cmd += ["-H", "Content-Type: application/json", "-d", data]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
        return dict(json.loads(out))
    request = urllib.request.Request(
        url,
        data=None if data is None else data.encode(),
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return dict(json.loads(response.read()))


class Lines:
    """Stdout of a child process, line by line, with a timeout on every wait."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        assert proc.stdout is not None
        stream = proc.stdout

        def pump() -> None:
            for line in stream:
                self._queue.put(line.rstrip("\n"))
            self._queue.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def until(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no line matching {pattern!r} in time; output so far:\n" + "\n".join(self.seen)
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, "the process ended; output:\n" + "\n".join(self.seen)
            self.seen.append(line)
            found = re.search(pattern, line)
            if found:
                return found


REPO = Path(__file__).resolve().parent.parent
#: The README's run command (it installs into .venv first, so it may take a while the first time),
#: and the command it ends in.
COMMANDS = {
    "readme-run-script": ["bash", str(REPO / "scripts" / "run.sh"), "--port", "0"],
    "agent-dispatch-up": [sys.executable, "-m", "agent_dispatch.cli", "up", "--port", "0"],
}


@pytest.fixture(params=list(COMMANDS))
def up(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Lines, Path]]:
    data_dir = tmp_path / "data"  # empty: does not even exist yet
    proc = subprocess.Popen(
        COMMANDS[request.param],
        cwd=REPO,
        env={**BASE_ENV, "AGENT_DISPATCH_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc, Lines(proc), data_dir
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_up_runs_the_demo_and_a_curl_turn(
    up: tuple[subprocess.Popen[str], Lines, Path], curl: str | None
) -> None:
    proc, lines, data_dir = up
    url = lines.until(r"gateway: (http://\S+)", timeout=900).group(1)  # run.sh may install first
    token = lines.until(r"token:\s+(\S+)").group(1)
    lines.until(r"curl -sS -X POST .*/api/turns")
    lines.until(r"demo turn \S+: succeeded")
    lines.until(r"demo turn completed")
    lines.until(r"Serving\. Press Ctrl-C to stop\.")

    # What `up` left in the data directory: the database, the key, and only a hash of the token.
    assert (data_dir / "agent-dispatch.sqlite3").exists()
    assert (data_dir / "signing.key").exists()
    tokens = (data_dir / "tokens.yaml").read_text()
    assert token not in tokens and "local" in tokens

    handle = http(curl, "POST", f"{url}/api/turns", token, {"kind": "hello", "payload": {"greeting": "hi"}})
    assert handle["state"] in {"ready", "leased", "running", "succeeded"}
    deadline = time.monotonic() + 60
    while True:
        view = http(curl, "GET", url + handle["status_url"], token)
        if view["state"] == "succeeded":
            break
        assert view["state"] not in {"failed", "cancelled", "dead_letter"}, view
        assert time.monotonic() < deadline, view
        time.sleep(0.1)
    assert view["outcome"] == "succeeded" and view["attempt"] == 1
    listed = http(curl, "GET", f"{url}/api/graph/jobs?state=succeeded", token)["jobs"]
    assert handle["job_id"] in {j["job_id"] for j in listed} and len(listed) == 2  # the demo turn + ours

    # Ctrl-C stops it cleanly, with the README's exit code for an interruption.
    proc.send_signal(signal.SIGINT)
    lines.until(r"^Stopped\.$", timeout=60)
    assert proc.wait(timeout=60) == 130


def test_up_twice_on_the_same_data_directory(tmp_path: Path) -> None:
    """A second run reuses the database and key, and issues a new token (the old one stops working)."""
    env = {**BASE_ENV, "AGENT_DISPATCH_DATA_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    tokens = []
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent_dispatch.cli", "up", "--port", "0", "--no-demo"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            lines = Lines(proc)
            tokens.append(lines.until(r"token:\s+(\S+)").group(1))
            lines.until(r"Serving\.")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert tokens[0] != tokens[1]
    stored = (tmp_path / "tokens.yaml").read_text()
    assert tokens[0] not in stored and tokens[1] not in stored


def test_a_second_up_on_a_taken_port_writes_nothing(tmp_path: Path) -> None:
    """The README's second `bash scripts/run.sh` while one runs: it exits 3, and the running one's
    printed token keeps working (the tokens file is not rewritten before the port is bound)."""
    env = {**BASE_ENV, "AGENT_DISPATCH_DATA_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "agent_dispatch.cli", "up", "--port", "0", "--no-demo"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = Lines(first)
        url = lines.until(r"gateway: (http://\S+)").group(1)
        token = lines.until(r"token:\s+(\S+)").group(1)
        lines.until(r"Serving\.")
        tokens_file = tmp_path / "tokens.yaml"
        before = (tokens_file.read_bytes(), tokens_file.stat().st_mtime_ns)

        port = url.rsplit(":", 1)[1]
        second = subprocess.run(
            [sys.executable, "-m", "agent_dispatch.cli", "up", "--port", port, "--no-demo"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert second.returncode == 3, second.stdout + second.stderr
        assert f"cannot listen on port {port}" in second.stderr
        assert "token:" not in second.stdout  # no token was issued, so none is shown
        assert (tokens_file.read_bytes(), tokens_file.stat().st_mtime_ns) == before
        assert http(None, "GET", f"{url}/api/graph/jobs", token)["jobs"] == []

        first.send_signal(signal.SIGTERM)  # how a service manager stops it: a clean stop, 0
        assert first.wait(timeout=60) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)
