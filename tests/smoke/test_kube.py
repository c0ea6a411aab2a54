"""The Kubernetes control plane is real: pinned version, CEL validation, RBAC, kubectl, controllers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from testenv.kube import KUBERNETES_VERSION, ControlPlane

pytestmark = pytest.mark.kube

GROUP = "smoke.agent-dispatch.test"
PLURAL = "widgets"
TTL_MESSAGE = "spec.ttl must be at most 300 seconds"
PARTITIONS_MESSAGE = "spec.partitions may not decrease"


def _poll(check: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached within {timeout:.0f}s")


def _widget_crd() -> dict[str, Any]:
    spec_schema = {
        "type": "object",
        "required": ["ttl"],
        "properties": {
            "ttl": {"type": "integer", "minimum": 1},
            "partitions": {
                "type": "integer",
                "minimum": 1,
                # A transition rule: the kind of check the AgentDispatch CRD uses for partitions.
                "x-kubernetes-validations": [{"rule": "self >= oldSelf", "message": PARTITIONS_MESSAGE}],
            },
        },
        "x-kubernetes-validations": [
            {"rule": "self.ttl <= 300", "message": TTL_MESSAGE, "fieldPath": ".ttl"}
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": spec_schema}}},
                }
            ],
        },
    }


def _established(ext: client.ApiextensionsV1Api, name: str) -> bool:
    crd = ext.read_custom_resource_definition(name)
    conditions = (crd.status and crd.status.conditions) or []
    return any(c.type == "Established" and c.status == "True" for c in conditions)


@pytest.fixture(scope="module")
def widget_crd(kube_api: client.ApiClient) -> Iterator[str]:
    ext = client.ApiextensionsV1Api(kube_api)
    body = _widget_crd()
    name = body["metadata"]["name"]
    ext.create_custom_resource_definition(body)
    try:
        _poll(lambda: _established(ext, name), timeout=60, what=f"CRD {name} Established")
        yield name
    finally:
        ext.delete_custom_resource_definition(name)


def _widget(name: str, ttl: int, partitions: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"ttl": ttl, "partitions": partitions},
    }


def _create(api: client.CustomObjectsApi, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = api.create_namespaced_custom_object(GROUP, "v1", namespace, PLURAL, body)
    return result


def test_server_reports_the_pinned_version(kube: ControlPlane, kube_api: client.ApiClient) -> None:
    assert kube.version == KUBERNETES_VERSION
    assert client.VersionApi(kube_api).get_code().git_version == KUBERNETES_VERSION


def test_cel_rule_accepts_valid_and_rejects_violating_object(
    kube_api: client.ApiClient, widget_crd: str, kube_namespace: str
) -> None:
    objects = client.CustomObjectsApi(kube_api)
    created = _create(objects, kube_namespace, _widget("ok", ttl=300))
    assert created["spec"]["ttl"] == 300

    with pytest.raises(ApiException) as rejected:
        _create(objects, kube_namespace, _widget("too-long", ttl=301))

    assert rejected.value.status == 422
    status = json.loads(rejected.value.body)
    assert TTL_MESSAGE in status["message"]
    assert any(cause.get("field") == "spec.ttl" for cause in status["details"]["causes"])


def test_cel_transition_rule_rejects_a_decrease(
    kube_api: client.ApiClient, widget_crd: str, kube_namespace: str
) -> None:
    objects = client.CustomObjectsApi(kube_api)
    _create(objects, kube_namespace, _widget("grows", ttl=60, partitions=3))
    objects.patch_namespaced_custom_object(
        GROUP, "v1", kube_namespace, PLURAL, "grows", {"spec": {"partitions": 6}}
    )

    with pytest.raises(ApiException) as rejected:
        objects.patch_namespaced_custom_object(
            GROUP, "v1", kube_namespace, PLURAL, "grows", {"spec": {"partitions": 2}}
        )

    assert rejected.value.status == 422
    assert PARTITIONS_MESSAGE in json.loads(rejected.value.body)["message"]


def test_kubectl_applies_and_gets_custom_objects(
    kube: ControlPlane, widget_crd: str, kube_namespace: str
) -> None:
    kube.kubectl(
        "apply", "-n", kube_namespace, "-f", "-", input=yaml.safe_dump(_widget("from-kubectl", ttl=30))
    )

    got = kube.kubectl("get", f"{PLURAL}.{GROUP}", "-n", kube_namespace, "-o", "json")

    items = json.loads(got.stdout)["items"]
    assert [(item["metadata"]["name"], item["spec"]["ttl"]) for item in items] == [("from-kubectl", 30)]
    violating = kube.kubectl(
        "apply",
        "-n",
        kube_namespace,
        "-f",
        "-",
        check=False,
        input=yaml.safe_dump(_widget("from-kubectl", ttl=999)),
    )
    assert violating.returncode != 0
    assert TTL_MESSAGE in violating.stderr


def test_rbac_limits_a_service_account_token(
    kube: ControlPlane, kube_api: client.ApiClient, kube_namespace: str
) -> None:
    core = client.CoreV1Api(kube_api)
    rbac = client.RbacAuthorizationV1Api(kube_api)
    core.create_namespaced_service_account(kube_namespace, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(
        kube_namespace,
        {
            "metadata": {"name": "configmap-reader"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        kube_namespace,
        {
            "metadata": {"name": "reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmap-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": kube_namespace}],
        },
    )
    token = core.create_namespaced_service_account_token(
        "reader", kube_namespace, {"spec": {"expirationSeconds": 600}}
    ).status.token
    as_reader = kube.kubeconfig_for_token(token, f"{kube_namespace}-reader")

    def can(verb: str, resource: str) -> str:
        proc = kube.kubectl(
            "auth", "can-i", verb, resource, "-n", kube_namespace, check=False, kubeconfig=as_reader
        )
        return proc.stdout.strip()

    assert can("list", "configmaps") == "yes"
    assert can("list", "secrets") == "no"
    assert can("create", "configmaps") == "no"
    denied = kube.kubectl("get", "secrets", "-n", kube_namespace, check=False, kubeconfig=as_reader)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()


def test_controller_manager_turns_a_deployment_into_a_replicaset(
    kube: ControlPlane, kube_api: client.ApiClient, kube_namespace: str
) -> None:
    kube.start_controller_manager()
    apps = client.AppsV1Api(kube_api)
    labels = {"app": "smoke"}
    apps.create_namespaced_deployment(
        kube_namespace,
        {
            "metadata": {"name": "smoke"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": "example.invalid/c:1"}]},
                },
            },
        },
    )

    def replicaset_with_two_pods() -> bool:
        sets = apps.list_namespaced_replica_set(kube_namespace).items
        pods = client.CoreV1Api(kube_api).list_namespaced_pod(kube_namespace).items
        return len(sets) == 1 and sets[0].spec.replicas == 2 and len(pods) == 2

    _poll(replicaset_with_two_pods, timeout=90, what="ReplicaSet with 2 Pods")
