"""Pytest plugins that hand tests real loopback services (see testenv/)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

from testenv._common import ServiceUnavailable, in_ci

T = TypeVar("T")

#: Services the session started, with their versions, for the closing summary line.
USED: dict[str, str] = {}


def start_or_skip(service: str, start: Callable[[], T]) -> T:
    """Start a service; outside CI a failure skips the test naming the service, in CI it fails it."""
    try:
        started = start()
    except ServiceUnavailable as exc:
        if in_ci():
            pytest.fail(f"{service} could not start (CI=true, so this is a failure):\n{exc}", pytrace=False)
        pytest.skip(f"{service} unavailable: {str(exc).splitlines()[0] if str(exc) else exc!r}")
    USED[service] = str(getattr(started, "version", "") or "")
    return started
