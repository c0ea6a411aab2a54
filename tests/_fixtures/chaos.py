"""Pytest plugin: the chaos suite's options ``--chaos-seed``, ``--chaos-duration`` and ``--chaos-report``.

Short mode (the default duration) runs in the default suite (marker ``chaos``, tests/chaos); soak
mode is the same tests with a longer duration, e.g. ``pytest tests/chaos --chaos-duration=600``
or ``bash scripts/test.sh -m chaos --chaos-duration=600``. Registered from tests/conftest.py, so
the options work whatever paths pytest is given; ``CHAOS_DURATION``/``CHAOS_SEED``/``CHAOS_REPORT``
work too.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

#: Seconds of fault injection per transport in short mode (CI).
SHORT_DURATION_S = 20.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chaos", "fault injection (tests/chaos)")
    group.addoption(
        "--chaos-seed",
        type=int,
        default=None,
        help="seed of the fault plan and the clients' choices (default: random, printed)",
    )
    group.addoption(
        "--chaos-duration",
        type=float,
        default=None,
        help=f"seconds of fault injection per transport (default {SHORT_DURATION_S:g}; soak: 600)",
    )
    group.addoption(
        "--chaos-report",
        default=None,
        help="append one JSON line per chaos run (figures for docs/reliability.md) to this file",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A chaos test's timeout follows its duration (pytest-timeout reads markers before the test
    runs, so the test cannot set its own): the faults, the 300 s RTO, and room for start-up."""
    given = _option(config, "--chaos-duration", "CHAOS_DURATION")
    duration = float(given) if given is not None else SHORT_DURATION_S
    here = Path(__file__).resolve().parents[1] / "chaos"
    for item in items:
        if item.get_closest_marker("chaos") and here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.timeout(3 * duration + 300 + 600))


def _option(config: pytest.Config, name: str, env: str) -> str | None:
    try:
        value = config.getoption(name)
    except ValueError:  # the options were not registered (this plugin not loaded)
        value = None
    if value is None:
        value = os.environ.get(env) or None
    return None if value is None else str(value)


@pytest.fixture(scope="session")
def chaos_seed(pytestconfig: pytest.Config) -> int:
    given = _option(pytestconfig, "--chaos-seed", "CHAOS_SEED")
    return int(given) if given is not None else random.SystemRandom().randrange(1, 2**31)


@pytest.fixture(scope="session")
def chaos_duration(pytestconfig: pytest.Config) -> float:
    given = _option(pytestconfig, "--chaos-duration", "CHAOS_DURATION")
    return float(given) if given is not None else SHORT_DURATION_S


@pytest.fixture(scope="session")
def chaos_report(pytestconfig: pytest.Config) -> Path | None:
    given = _option(pytestconfig, "--chaos-report", "CHAOS_REPORT")
    return Path(given) if given else None
