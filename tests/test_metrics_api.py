"""The pure parts of the external-metrics API: discovery, selectors, staleness, the response format,
and the front-proxy identity rules (the server itself runs on the real node: tests/node)."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from agent_dispatch.metrics_api import _api, _auth
from agent_dispatch.operator import _status

NOW = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
INSTANCE = "agent-dispatch.io/instance"


def _dispatch(
    name: str, depth: object = 7, age_s: float | None = 1.0, labels: dict[str, str] | None = None
) -> dict[str, object]:
    status: dict[str, object] = {"queueDepth": depth}
    if age_s is not None:
        status["queueDepthTime"] = _api.rfc3339(NOW - dt.timedelta(seconds=age_s))
    return {"metadata": {"name": name, "namespace": "ns", "labels": labels or {}}, "status": status}


def test_discovery_documents_name_the_group_version_and_metric() -> None:
    groups = _api.api_group_list()
    assert groups["kind"] == "APIGroupList"
    assert [g["name"] for g in groups["groups"]] == ["external.metrics.k8s.io"]
    assert groups["groups"][0]["preferredVersion"] == {
        "groupVersion": "external.metrics.k8s.io/v1beta1",
        "version": "v1beta1",
    }
    resources = _api.api_resource_list()
    assert (
        resources["kind"] == "APIResourceList"
        and resources["groupVersion"] == "external.metrics.k8s.io/v1beta1"
    )
    assert resources["resources"] == [
        {
            "name": "agent_dispatch_queue_depth",
            "singularName": "",
            "namespaced": True,
            "kind": "ExternalMetricValueList",
            "verbs": ["get"],
        }
    ]
    assert _api.openapi_v2()["swagger"] == "2.0"
    json.dumps([groups, resources, _api.openapi_v2(), _api.openapi_v3()])  # all serialisable


def test_unknown_metric_is_the_apis_not_found_status() -> None:
    body = _api.metric_not_found("nope", "ns")
    assert body["kind"] == "Status" and body["code"] == 404 and body["reason"] == "NotFound"
    assert "nope" in body["message"]


_label_key = st.from_regex(r"\A([a-z]{1,5}\.io/)?[a-z][a-z0-9-]{0,6}[a-z0-9]\Z")
_label_value = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,6}[a-z0-9])?\Z")
_labels = st.dictionaries(_label_key, _label_value, max_size=4)


@given(wanted=_labels, have=_labels)
def test_match_labels_select_exactly_the_supersets(wanted: dict[str, str], have: dict[str, str]) -> None:
    selector = ",".join(f"{k}={v}" for k, v in wanted.items())
    parsed = _api.parse_selector(selector)
    assert _api.selector_matches(parsed, have) == (wanted.items() <= have.items())


@given(key=_label_key, values=st.sets(_label_value, min_size=1, max_size=3), have=_labels)
def test_set_based_requirements(key: str, values: set[str], have: dict[str, str]) -> None:
    joined = ", ".join(sorted(values))
    inside = _api.selector_matches(_api.parse_selector(f"{key} in ({joined})"), have)
    outside = _api.selector_matches(_api.parse_selector(f"{key} notin ({joined})"), have)
    assert inside == (have.get(key) in values)
    assert outside == (not inside)
    assert _api.selector_matches(_api.parse_selector(key), have) == (key in have)
    assert _api.selector_matches(_api.parse_selector(f"!{key}"), have) == (key not in have)
    assert _api.selector_matches(_api.parse_selector(f"{key}!={sorted(values)[0]}"), have) == (
        have.get(key) != sorted(values)[0]
    )


@pytest.mark.parametrize("bad", ["a b", "k in ()", "=v", "k==v==w", "k in (a", "-k=v"])
def test_bad_selectors_are_refused_with_the_requirement(bad: str) -> None:
    with pytest.raises(_api.SelectorError):
        _api.parse_selector(bad)


def test_the_operators_hpa_selector_picks_its_own_instance_by_name() -> None:
    mine, other = _dispatch("mine"), _dispatch("other", labels={"team": "a"})
    selector = _api.parse_selector(f"{INSTANCE}=mine")
    assert [o for o in (mine, other) if _api.selector_matches(selector, _api.instance_labels(o))] == [mine]
    # The name wins over a label that claims another instance.
    spoof = _dispatch("x", labels={INSTANCE: "mine"})
    assert _api.instance_labels(spoof)[INSTANCE] == "x"
    # Other labels select too, and the empty selector takes every instance.
    assert _api.selector_matches(_api.parse_selector("team=a"), _api.instance_labels(other))
    assert _api.parse_selector("") == ()


def test_fresh_depth_is_a_number_and_stale_or_missing_is_a_problem() -> None:
    fresh = _api.reading(_dispatch("a", depth=12, age_s=5), NOW, 30)
    assert fresh.problem is None and fresh.depth == 12
    stale = _api.reading(_dispatch("a", depth=12, age_s=31), NOW, 30)
    assert stale.problem is not None and "stale" in stale.problem
    assert "no queue depth time" in (_api.reading(_dispatch("a", age_s=None), NOW).problem or "")
    assert "no queue depth" in (_api.reading(_dispatch("a", depth=None), NOW).problem or "")
    assert _api.reading(_dispatch("a", depth=True), NOW).problem is not None


@given(depths=st.lists(st.integers(min_value=0, max_value=10**9), max_size=5))
def test_value_list_has_one_item_per_instance_with_integer_quantities(depths: list[int]) -> None:
    readings = [_api.reading(_dispatch(f"d{i}", depth=d), NOW) for i, d in enumerate(depths)]
    body = _api.value_list(readings)
    assert (
        body["kind"] == "ExternalMetricValueList" and body["apiVersion"] == "external.metrics.k8s.io/v1beta1"
    )
    assert [int(item["value"]) for item in body["items"]] == depths
    for i, item in enumerate(body["items"]):
        assert item["metricName"] == "agent_dispatch_queue_depth"
        assert item["metricLabels"][INSTANCE] == f"d{i}"
        assert item["timestamp"].endswith("Z")


CONFIG_MAP = {
    "requestheader-client-ca-file": "-----BEGIN CERTIFICATE-----\n...",
    "requestheader-allowed-names": '["front-proxy-client"]',
    "requestheader-username-headers": '["X-Remote-User"]',
    "requestheader-group-headers": '["X-Remote-Group"]',
    "requestheader-extra-headers-prefix": '["X-Remote-Extra-"]',
}
PROXY_CERT = {"subject": ((("commonName", "front-proxy-client"),),)}


def _headers(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


def test_requestheader_config_comes_from_the_configmap() -> None:
    config = _auth.requestheader_config(CONFIG_MAP)
    assert config is not None and config.allowed_names == ("front-proxy-client",)
    assert _auth.requestheader_config({}) is None
    assert _auth.requestheader_config({"client-ca-file": "x"}) is None


def test_the_front_proxy_vouches_for_user_groups_and_extra() -> None:
    config = _auth.requestheader_config(CONFIG_MAP)
    assert config is not None
    headers = _headers(
        ("x-remote-user", "alice"),
        ("X-Remote-Group", "devs"),
        ("X-Remote-Group", "system:authenticated"),
        ("X-Remote-Extra-Scopes%2Fa", "one"),
        ("Authorization", "Bearer ignored"),
    )
    user = _auth.front_proxy_user(config, PROXY_CERT, headers)
    assert user == _auth.User("alice", ("devs", "system:authenticated"), {"scopes/a": ("one",)})
    body = _auth.access_review_body(user, "ns", "agent_dispatch_queue_depth")
    assert body["spec"]["resourceAttributes"] == {
        "verb": "list",
        "group": "external.metrics.k8s.io",
        "version": "v1beta1",
        "resource": "agent_dispatch_queue_depth",
        "namespace": "ns",
    }
    assert body["spec"]["user"] == "alice" and body["spec"]["extra"] == {"scopes/a": ["one"]}


def test_headers_without_the_front_proxy_certificate_are_not_believed() -> None:
    config = _auth.requestheader_config(CONFIG_MAP)
    assert config is not None
    forged = _headers(("X-Remote-User", "system:admin"), ("X-Remote-Group", "system:masters"))
    assert _auth.front_proxy_user(config, None, forged) is None
    assert _auth.front_proxy_user(config, {}, forged) is None
    other = {"subject": ((("commonName", "someone-else"),),)}
    with pytest.raises(_auth.Unauthenticated, match="not an allowed front-proxy name"):
        _auth.front_proxy_user(config, other, forged)
    with pytest.raises(_auth.Unauthenticated, match="without a user header"):
        _auth.front_proxy_user(config, PROXY_CERT, _headers())
    assert _auth.bearer_token(_headers(("Authorization", "Bearer abc"))) == "abc"
    assert _auth.bearer_token(_headers(("Authorization", "Basic abc"))) is None


def _hpa(active: str, reason: str, **status: object) -> dict[str, object]:
    conditions = [{"type": "ScalingActive", "status": active, "reason": reason, "message": "m"}]
    return {"status": {"conditions": conditions, **status}}


def test_metric_condition_follows_the_hpa_and_the_depth() -> None:
    ok = _status.metric_condition(3, _hpa("True", "ValidMetricFound"))
    assert (ok.type, ok.status) == ("MetricAvailable", "True")
    down = _status.metric_condition(3, _hpa("False", "FailedGetExternalMetric"))
    assert (down.status, down.reason) == ("False", "MetricUnavailable")
    assert "holds its replica count" in down.message and "FailedGetExternalMetric" in down.message
    unknown = _status.metric_condition(None, None)
    assert (unknown.status, unknown.reason) == ("False", "QueueDepthUnknown")
    # A fresh HPA without status yet does not count as a failure.
    assert _status.metric_condition(0, {}).status == "True"


def test_autoscaler_status_reports_the_hpas_own_numbers() -> None:
    hpa = _hpa(
        "True", "ValidMetricFound", currentReplicas=2, desiredReplicas=4, lastScaleTime="2025-01-01T00:00:00Z"
    )
    assert _status.autoscaler_status("hpa", hpa) == {
        "mode": "hpa",
        "currentReplicas": 2,
        "desiredReplicas": 4,
        "lastScaleTime": "2025-01-01T00:00:00Z",
    }
    assert _status.autoscaler_status("hpa", None) == {"mode": "hpa"}
