"""Pytest plugin: how pytest-xdist spreads the suite over worker processes (``-n``).

Each worker starts the session services its tests ask for. The services below are kept to one
worker, so each starts once: the node (a control plane, kubelet, containerd and its pods) is the
heaviest part of the suite to start and keep running, and two three-broker Kafka clusters would
crowd two cores. Every other service (PostgreSQL, one Kafka broker, the loopback control plane)
starts once per worker that needs it, on ports of its own, and every test has its own database,
topic or namespace, so the rest of the suite spreads freely.

xdist's own ``--dist loadgroup`` is not used: it marks a group by rewriting ``item._nodeid``,
which pytest 9 no longer reads, so the groups were silently ignored (two nodes started). The
controller sees only node ids, so the groups are named by where the tests live, and collection
checks that every test of a grouped service lives where its group says.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

#: Worker group -> the fixture that makes a test belong to it, and the node-id prefixes of its tests.
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "node": ("node", ("tests/node/",)),
    "kafka_cluster": (
        "kafka_cluster",
        (
            "tests/smoke/test_kafka_cluster.py::",
            "tests/chaos/test_chaos.py::test_faults_under_load_lose_nothing_and_commit_once[kafka-replicated]",
        ),
    ),
}


def worker_group(nodeid: str) -> str | None:
    """The group whose worker runs the test ``nodeid``, or None for any worker."""
    for group, (_, prefixes) in GROUPS.items():
        if nodeid.startswith(prefixes):
            return group
    return None


class GroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling, a scope being a group or else one test: a group goes to one
    worker as a whole (the largest first), single tests to whichever worker runs out of work."""

    def _split_scope(self, nodeid: str) -> str:
        return worker_group(nodeid) or nodeid


@pytest.hookimpl(optionalhook=True)  # an xdist hook, known only where xdist is loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> GroupScheduling:
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse a collection where a test of a grouped service would run outside its group's worker."""
    misplaced = []
    for item in items:
        for group, (fixture, _) in GROUPS.items():
            if fixture in getattr(item, "fixturenames", ()) and worker_group(item.nodeid) != group:
                misplaced.append(f"{item.nodeid} uses {fixture!r}, so it belongs under GROUPS[{group!r}]")
    if misplaced:
        raise pytest.UsageError("tests/_fixtures/groups.py:\n" + "\n".join(misplaced))
