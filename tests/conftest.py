"""Test session wiring: real loopback services come from the plugins in tests/_fixtures."""

from __future__ import annotations

from typing import Any

import pytest

from tests._fixtures import USED

pytest_plugins = [
    "tests._fixtures.services",
    "tests._fixtures.kube",
    "tests._fixtures.node",
    "tests._fixtures.chaos",
    "tests._fixtures.groups",
]


def pytest_sessionfinish(session: pytest.Session) -> None:
    # An xdist worker hands the services it started to the controller, which prints the summary.
    output: dict[str, Any] | None = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["services_used"] = dict(USED)


@pytest.hookimpl(optionalhook=True)  # an xdist hook, known only where xdist is loaded
def pytest_testnodedown(node: Any, error: object) -> None:
    USED.update(getattr(node, "workeroutput", {}).get("services_used", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if USED:
        used = ", ".join(version or name for name, version in sorted(USED.items()))
        terminalreporter.write_line(f"services used: {used}")
    else:
        terminalreporter.write_line("services used: none")
