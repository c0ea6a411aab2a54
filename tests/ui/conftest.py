"""The web UI under test: `agent-dispatch up` (gateway + workers on SQLite in a tmp data dir, the
sleep executor) and Debian's chromium driven by Playwright, with a fresh profile per session."""

from __future__ import annotations

import hashlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from testenv.browser import ARGS, ensure_browser
from tests._fixtures import start_or_skip

OTHER_TOKEN = "other-tenant-token-" + "x" * 20
BASE_ENV = {
    k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "TASK_QUEUE", "STATE_DB", "KAFKA_"))
}


@dataclass
class Server:
    url: str
    token: str
    admin_token: str
    data_dir: Path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/ui/" in str(item.fspath):
            item.add_marker(pytest.mark.ui)


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Where screenshots go: a tmp dir always, and AGENT_DISPATCH_UI_SCREENSHOTS (docs/ui) when set."""
    dirs = [tmp_path_factory.mktemp("ui-screenshots")]
    if os.environ.get("AGENT_DISPATCH_UI_SCREENSHOTS"):
        dirs.append(Path(os.environ["AGENT_DISPATCH_UI_SCREENSHOTS"]))
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return dirs


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("ui-data")
    digest = hashlib.sha256(OTHER_TOKEN.encode()).hexdigest()
    (data / "tokens.yaml").write_text(f"other: {digest}\n")
    env = {
        **BASE_ENV,
        "AGENT_DISPATCH_DATA_DIR": str(data),
        "AGENT_DISPATCH_EXECUTOR": "sleep",
        "AGENT_DISPATCH_SHUTDOWN_GRACE_S": "1",
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_dispatch.cli", "up", "--port", "0", "--no-demo", "-c", "4"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    found: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while "serving" not in found and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        for key, pattern in (
            ("url", r"gateway:\s+(\S+)"),
            ("token", r"token:\s+(\S+)"),
            ("admin", r"admin:\s+(\S+)"),
            ("ui", r"web UI:\s+(\S+)"),
        ):
            m = re.search(pattern, line)
            if m and key not in found:
                found[key] = m.group(1)
        if "Serving." in line:
            found["serving"] = "yes"
    assert {"url", "token", "admin", "ui"} <= set(found), f"`up` did not print what the UI needs: {found}"
    assert found["ui"] == found["url"] + "/ui/"
    yield Server(found["url"], found["token"], found["admin"], data)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def browser_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    executable = start_or_skip("chromium", ensure_browser)
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=str(executable),
            args=list(ARGS),
            headless=True,
            viewport={"width": 1280, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture()
def page(browser_context: Any) -> Iterator[Any]:
    """A tab whose console errors and uncaught exceptions fail the test."""
    tab = browser_context.new_page()
    errors: list[str] = []
    tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.console_errors = errors
    yield tab
    tab.close()
