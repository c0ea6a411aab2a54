"""Debian's chromium for the web UI's browser tests (driven by Playwright, never its own download).

``ensure_browser()`` returns the executable, installing the Debian package once per machine
(as root) when it is missing. Playwright's own browser download needs network access the test
machines do not have; the distribution's build is what the tests point Playwright at.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Final

from testenv._common import ServiceUnavailable, apt_install, cache_dir, file_lock

CHROMIUM: Final = Path("/usr/bin/chromium")
#: Flags for a hermetic headless run: no GPU, no sandbox (root in a container), no background traffic.
ARGS: Final = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def ensure_browser() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    if shutil.which("apt-get") is None:
        raise ServiceUnavailable("chromium is not installed and there is no apt-get to install it")
    with file_lock(cache_dir("locks") / "chromium.lock", timeout=1200):
        if not CHROMIUM.exists():
            apt_install(["chromium"], cache_dir("logs") / "chromium-apt.log")
    if not CHROMIUM.exists():
        raise ServiceUnavailable(f"apt-get installed chromium but {CHROMIUM} is missing")
    return CHROMIUM
