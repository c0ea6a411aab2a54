"""The pure parts of the external-metrics API: discovery documents, label selectors, the depth each
AgentDispatch reports, and the ``ExternalMetricValueList`` the HPA controller reads.

No I/O here, so every rule (which object a selector picks, when a depth is too old to scale on,
what a 404 looks like) is unit-tested without a cluster.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from agent_dispatch import k8s_names
from agent_dispatch.k8s_names import parse_time, rfc3339

GROUP: Final = "external.metrics.k8s.io"
VERSION: Final = "v1beta1"
GROUP_VERSION: Final = f"{GROUP}/{VERSION}"
METRIC: Final = k8s_names.QUEUE_DEPTH_METRIC
#: Every metric this server knows; any other name is the API's 404.
METRICS: Final = (METRIC,)
#: The operator refreshes ``.status.queueDepth`` every STATUS_INTERVAL_S (10 s); a reading older
#: than three refreshes means the operator (or the transport probe) is not keeping up, and
#: scaling on it would act on a backlog that may be long gone.
DEFAULT_MAX_AGE_S: Final = 30.0

# --- discovery -----------------------------------------------------------------------------------


def api_group() -> dict[str, Any]:
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": GROUP,
        "versions": [{"groupVersion": GROUP_VERSION, "version": VERSION}],
        "preferredVersion": {"groupVersion": GROUP_VERSION, "version": VERSION},
    }


def api_group_list() -> dict[str, Any]:
    """``/apis``: the one group this server serves (the aggregator merges it into its own)."""
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [api_group()]}


def api_resource_list() -> dict[str, Any]:
    """``/apis/external.metrics.k8s.io/v1beta1``: one namespaced resource per metric, as the
    custom-metrics-apiserver library lists them (kind ExternalMetricValueList, verb get)."""
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": [
            {
                "name": name,
                "singularName": "",
                "namespaced": True,
                "kind": "ExternalMetricValueList",
                "verbs": ["get"],
            }
            for name in METRICS
        ],
    }


def openapi_v2() -> dict[str, Any]:
    """A valid, empty OpenAPI v2 document: the aggregator merges each APIService's spec, and an
    empty one contributes nothing (the API has no schema clients need; kubectl get --raw works)."""
    return {
        "swagger": "2.0",
        "info": {"title": "agent-dispatch external metrics", "version": VERSION},
        "paths": {},
    }


def openapi_v3() -> dict[str, Any]:
    """``/openapi/v3``: the discovery of OpenAPI v3 documents; none are published."""
    return {"paths": {}}


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``meta/v1 Status`` failure, the body every Kubernetes API error carries."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def metric_not_found(metric: str, namespace: str) -> dict[str, Any]:
    """What custom-metrics-apiserver answers for a metric its provider does not know."""
    return status(
        404, "NotFound", f'the server could not find the metric "{metric}" in namespace "{namespace}"'
    )


# --- label selectors -------------------------------------------------------------------------------


class SelectorError(ValueError):
    """A label selector this server cannot parse (answered 400 with the reason)."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.operator == "exists":
            return present
        if self.operator == "!exists":
            return not present
        if self.operator in ("=", "in"):
            return present and value in self.values
        # "!=" and "notin" match objects without the label, as Kubernetes selectors do.
        return not present or value not in self.values


_KEY: Final = r"(?:[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_VALUE: Final = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET = re.compile(rf"^\s*(?P<key>{_KEY})\s+(?P<op>in|notin)\s+\((?P<values>[^)]*)\)\s*$")
_EQ = re.compile(rf"^\s*(?P<key>{_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>{_VALUE})\s*$")
_EXISTS = re.compile(rf"^\s*(?P<not>!?)\s*(?P<key>{_KEY})\s*$")


def _split(selector: str) -> list[str]:
    """Split on the commas that separate requirements, not those inside ``in (a,b)``."""
    parts, depth, current = [], 0, ""
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def parse_selector(selector: str) -> tuple[Requirement, ...]:
    """A Kubernetes label selector in its string form (what ``labelSelector=`` carries); the
    empty selector selects everything."""
    if not selector.strip():
        return ()
    found: list[Requirement] = []
    for part in _split(selector):
        if m := _SET.match(part):
            values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
            if not values:
                raise SelectorError(f"selector {part.strip()!r}: a set needs at least one value")
            found.append(Requirement(m["key"], m["op"], values))
        elif m := _EQ.match(part):
            op = "!=" if m["op"] == "!=" else "="
            found.append(Requirement(m["key"], op, frozenset({m["value"]})))
        elif m := _EXISTS.match(part):
            found.append(Requirement(m["key"], "!exists" if m["not"] else "exists"))
        else:
            raise SelectorError(f"invalid label selector requirement {part.strip()!r}")
    return tuple(found)


def selector_matches(requirements: Sequence[Requirement], labels: Mapping[str, str]) -> bool:
    return all(r.matches(labels) for r in requirements)


def instance_labels(obj: Mapping[str, Any]) -> dict[str, str]:
    """The labels an AgentDispatch is selected by: its own metadata labels, plus
    ``agent-dispatch.io/instance: <its name>`` (always, overriding a label of that key), so the
    HPA the operator renders (matchLabels on that key) selects exactly its own instance."""
    meta = obj.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    labels[k8s_names.INSTANCE_LABEL] = str(meta.get("name", ""))
    return labels


# --- depth readings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """One AgentDispatch's depth as the operator last wrote it; ``problem`` when unusable."""

    name: str
    labels: Mapping[str, str]
    depth: int | None
    observed: dt.datetime | None
    problem: str | None = None


def reading(obj: Mapping[str, Any], now: dt.datetime, max_age_s: float = DEFAULT_MAX_AGE_S) -> Reading:
    """The depth of one AgentDispatch: ``.status.queueDepth``, dated by ``.status.queueDepthTime``
    (written by the operator at each refresh while autoscaling is on). Missing, unknown (the
    transport could not be asked) or older than ``max_age_s`` is a problem, never a number."""
    name = str((obj.get("metadata") or {}).get("name", ""))
    labels = instance_labels(obj)
    st = obj.get("status") or {}
    depth = st.get("queueDepth")
    observed = parse_time(st.get("queueDepthTime"))
    if observed is None:
        return Reading(name, labels, None, None, f"AgentDispatch {name} reports no queue depth time yet")
    if not isinstance(depth, int) or isinstance(depth, bool):
        return Reading(name, labels, None, observed, f"AgentDispatch {name} reports no queue depth")
    age = (now - observed).total_seconds()
    if age > max_age_s:
        return Reading(
            name,
            labels,
            depth,
            observed,
            f"queue depth of AgentDispatch {name} is stale: observed {age:.0f}s ago (limit {max_age_s:.0f}s)",
        )
    return Reading(name, labels, depth, observed)


def value_list(readings: Sequence[Reading], metric: str = METRIC) -> dict[str, Any]:
    """``ExternalMetricValueList`` with one item per selected AgentDispatch. The HPA sums the items
    (AverageValue divides that sum by the replica count), so one item per instance is exactly
    the backlog; the value is a Kubernetes quantity (a plain integer string)."""
    return {
        "kind": "ExternalMetricValueList",
        "apiVersion": GROUP_VERSION,
        "metadata": {},
        "items": [
            {
                "metricName": metric,
                "metricLabels": dict(r.labels),
                "timestamp": rfc3339(r.observed) if r.observed else None,
                "value": str(int(r.depth or 0)),
            }
            for r in readings
        ],
    }
