"""Test session wiring: real loopback services come from the plugins in tests/_fixtures."""

from __future__ import annotations

import pytest

from tests._fixtures import USED

pytest_plugins = [
    "tests._fixtures.services",
    "tests._fixtures.kube",
    "tests._fixtures.node",
    "tests._fixtures.chaos",
]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if USED:
        used = ", ".join(version or name for name, version in sorted(USED.items()))
        terminalreporter.write_line(f"services used: {used}")
    else:
        terminalreporter.write_line("services used: none")
