"""The few Kubernetes calls the operator makes, behind a small Protocol.

The reconcile logic talks to :class:`Cluster`, so unit tests drive it with an in-memory fake and
the kube tests with the real API server. Writes are server-side applies under the operator's
own field manager: it owns exactly the fields it renders and nothing else (an HPA's replicas, a
user's extra annotations).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any, Final, Protocol

from agent_dispatch import k8s_names

#: Kinds the operator reads or writes: (apiVersion, kind) -> (plural, namespaced).
KINDS: Final[dict[tuple[str, str], str]] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "Secret"): "secrets",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    (k8s_names.API_VERSION, k8s_names.KIND): k8s_names.PLURAL,
}

REQUEST_TIMEOUT_S: Final = 30


class ClusterError(RuntimeError):
    """A Kubernetes call failed; ``status`` is the HTTP status (0 when there was no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Cluster(Protocol):
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool: ...

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str
    ) -> list[dict[str, Any]]: ...

    def read_secret(self, namespace: str, name: str, key: str) -> str | None: ...


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    plural = KINDS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def secret_value(secret: Mapping[str, Any] | None, key: str) -> str | None:
    """The decoded value of ``key`` in a Secret object, or None."""
    if not secret:
        return None
    raw = (secret.get("data") or {}).get(key)
    if raw is None:
        string = (secret.get("stringData") or {}).get(key)
        return str(string) if string is not None else None
    try:
        return base64.b64decode(raw).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


class KubeCluster:
    """:class:`Cluster` over the kubernetes client's ApiClient (kubeconfig or in-cluster)."""

    def __init__(self, api_client: Any | None = None) -> None:
        if api_client is None:
            api_client = new_api_client()
        self._api = api_client

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> tuple[int, Any]:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        method_, url, headers_, body_, post = self._api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self._api.call_api(
                method_, url, headers_, body_, post, _request_timeout=REQUEST_TIMEOUT_S
            )
            response.read()
        except ApiException as exc:
            return int(exc.status or 0), _json_or_text(exc.body)
        except OSError as exc:  # the API server is down or unreachable
            raise ClusterError(0, f"{type(exc).__name__}: Kubernetes API unreachable") from None
        return int(response.status), _json_or_text(response.data)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        status, data = self._call("GET", resource_path(api_version, kind, namespace, name))
        if status == 404:
            return None
        _raise_for(status, data, f"get {kind} {name}")
        return dict(data)

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        status, data = self._call(
            "PATCH",
            path,
            query=[("fieldManager", k8s_names.FIELD_MANAGER), ("force", "true")],
            body=json.dumps(obj),
            content_type="application/apply-patch+yaml",
        )
        _raise_for(status, data, f"apply {obj['kind']} {meta['name']}")
        return dict(data)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        status, data = self._call(
            "DELETE",
            resource_path(api_version, kind, namespace, name),
            body={"propagationPolicy": "Background"},
            content_type="application/json",
        )
        if status == 404:
            return False
        _raise_for(status, data, f"delete {kind} {name}")
        return True

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        status, data = self._call(
            "GET", resource_path(api_version, kind, namespace), query=[("labelSelector", label_selector)]
        )
        if status == 404:
            return []
        _raise_for(status, data, f"list {kind}")
        return [dict(item) for item in data.get("items", [])]

    def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        return secret_value(self.get("v1", "Secret", namespace, name), key)


def _json_or_text(raw: Any) -> Any:
    if isinstance(raw, bytes | bytearray):
        raw = raw.decode("utf-8", "replace")
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return {"message": raw[:500]}
    return raw if raw is not None else {}


def _raise_for(status: int, data: Any, what: str) -> None:
    if 200 <= status < 300:
        return
    message = data.get("message", "") if isinstance(data, Mapping) else str(data)
    raise ClusterError(status, f"{what}: HTTP {status}: {message}")


def new_api_client() -> Any:
    """An ApiClient from the in-cluster ServiceAccount, else from the kubeconfig ($KUBECONFIG)."""
    from kubernetes import client, config

    # The loaders are untyped; called through Any so strict typing holds with or without stubs.
    load_incluster: Any = config.load_incluster_config
    from_kubeconfig: Any = config.new_client_from_config
    try:
        load_incluster()
        return client.ApiClient()
    except config.ConfigException:
        return from_kubeconfig(persist_config=False)
