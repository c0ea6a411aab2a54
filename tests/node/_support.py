"""Helpers for tests on the real node: pods, their logs, and the operator pod the chart runs."""

from __future__ import annotations

import json
import re
from typing import Any

from testenv.node import NodeCluster
from tests.helm._support import EXPECTED_FORBIDDEN


def pods(node: NodeCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = node.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def seconds_to_ready(pod: dict[str, Any]) -> float:
    """From the pod's creation to its Ready condition (image present: start-up of the process)."""
    from datetime import datetime

    created = datetime.fromisoformat(pod["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    (cond,) = [c for c in pod["status"]["conditions"] if c["type"] == "Ready"]
    return (
        datetime.fromisoformat(cond["lastTransitionTime"].replace("Z", "+00:00")) - created
    ).total_seconds()


def restarts(pod: dict[str, Any]) -> int:
    return sum(s.get("restartCount", 0) for s in pod.get("status", {}).get("containerStatuses", []))


def forbidden_lines(log: str) -> list[str]:
    """Log lines reporting a permission error, except kopf's expected namespaced-mode fallbacks."""
    return [
        line
        for line in log.splitlines()
        if re.search(r"forbidden|status\W{0,3}403\b|\b403 \w", line, re.IGNORECASE)
        and not EXPECTED_FORBIDDEN.search(line)
    ]


def failure(reason: str, *detail: str) -> AssertionError:
    """An AssertionError that states ``reason`` before and again after the (long) ``detail``: CI
    shows a failure's message by its head and its tail, and cuts the middle."""
    return AssertionError("\n".join((reason, *detail, f"=> {reason}")))


def describe(node: NodeCluster, namespace: str) -> str:
    """Pods, events and the kubelet's last lines: what a failing assertion should show."""
    parts = [
        node.kubectl("get", "pods,deployments,leases", "-n", namespace, "-o", "wide", check=False).stdout,
        node.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout[
            -4000:
        ],
        node.log_tail("kubelet", 10),
    ]
    for pod in json.loads(
        node.kubectl("get", "pods", "-n", namespace, "-o", "json", check=False).stdout or "{}"
    ).get("items", []):
        name = pod["metadata"]["name"]
        for previous in ("--previous", None):
            args = ["logs", "-n", namespace, name, "--all-containers", "--tail=15"]
            out = node.kubectl(*args, *([previous] if previous else []), check=False)
            parts.append(f"--- logs {name} {previous or ''}\n{out.stdout}{out.stderr}")
    return "\n".join(parts)
