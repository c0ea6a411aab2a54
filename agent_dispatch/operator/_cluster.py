"""The few Kubernetes calls the operator makes, behind a small Protocol.

The reconcile logic talks to :class:`Cluster`, so unit tests drive it with an in-memory fake and
the kube tests with the real API server through the kubernetes client's DynamicClient. Writes
are server-side applies under the operator's own field manager: it owns exactly the fields it
renders and nothing else (an HPA's replicas, a user's extra annotations).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from agent_dispatch import k8s_names
from agent_dispatch.k8s_client import new_api_client

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
    """:class:`Cluster` over the kubernetes client's DynamicClient (kubeconfig or in-cluster).

    The DynamicClient finds each kind's path by API discovery (a kind installed later, such as
    KEDA's ScaledObject, is found on first use) and applies with the server-side apply patch.
    Discovery needs the API server, so it starts on the first call, not at construction.
    """

    def __init__(self, api_client: Any | None = None) -> None:
        self._api_client = api_client
        self._dynamic: Any = None

    def _resource(self, api_version: str, kind: str) -> Any | None:
        """The kind's API resource, or None when the API server does not serve it."""
        from kubernetes import dynamic
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        def discover() -> Any:
            if self._dynamic is None:
                self._dynamic = dynamic.DynamicClient(self._api_client or new_api_client())
            try:
                return self._dynamic.resources.get(api_version=api_version, kind=kind)
            except ResourceNotFoundError:
                return None

        return _calling(discover, f"discover {kind}")

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        resource = self._resource(api_version, kind)
        if resource is None:
            return None
        found = _calling(
            lambda: resource.get(name=name, namespace=namespace, _request_timeout=REQUEST_TIMEOUT_S),
            f"get {kind} {name}",
            missing=None,
        )
        return None if found is None else dict(found.to_dict())

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        what = f"apply {obj['kind']} {meta['name']}"
        resource = self._resource(obj["apiVersion"], obj["kind"])
        if resource is None:
            raise ClusterError(
                404, f"{what}: HTTP 404: the server does not serve {obj['apiVersion']} {obj['kind']}"
            )
        applied = _calling(
            lambda: resource.server_side_apply(
                body=dict(obj),
                name=meta["name"],
                namespace=meta["namespace"],
                field_manager=k8s_names.FIELD_MANAGER,
                force_conflicts=True,
                _request_timeout=REQUEST_TIMEOUT_S,
            ),
            what,
        )
        return dict(applied.to_dict())

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        resource = self._resource(api_version, kind)
        if resource is None:
            return False
        deleted = _calling(
            lambda: resource.delete(
                name=name,
                namespace=namespace,
                body={"propagationPolicy": "Background"},
                _request_timeout=REQUEST_TIMEOUT_S,
            ),
            f"delete {kind} {name}",
            missing=None,
        )
        return deleted is not None

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        resource = self._resource(api_version, kind)
        if resource is None:
            return []
        listed = _calling(
            lambda: resource.get(
                namespace=namespace, label_selector=label_selector, _request_timeout=REQUEST_TIMEOUT_S
            ),
            f"list {kind}",
            missing=None,
        )
        return [] if listed is None else [dict(item) for item in listed.to_dict().get("items", [])]

    def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        return secret_value(self.get("v1", "Secret", namespace, name), key)


_MISSING: Final = object()


def _calling(fn: Callable[[], Any], what: str, *, missing: Any = _MISSING) -> Any:
    """``fn()``, its failures as :class:`ClusterError`; a 404 answers ``missing`` when given."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.dynamic.exceptions import DynamicApiError
    from urllib3.exceptions import HTTPError

    try:
        return fn()
    except (DynamicApiError, ApiException) as exc:
        status = int(getattr(exc, "status", 0) or 0)
        if status == 404 and missing is not _MISSING:
            return missing
        raise ClusterError(status, f"{what}: HTTP {status}: {_message(exc)}") from None
    except (HTTPError, OSError) as exc:  # the API server is down or unreachable
        raise ClusterError(0, f"{what}: {type(exc).__name__}: Kubernetes API unreachable") from None


def _message(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, bytes | bytearray):
        body = body.decode("utf-8", "replace")
    try:
        data = json.loads(body) if isinstance(body, str) else None
    except ValueError:
        data = None
    if isinstance(data, Mapping):
        return str(data.get("message", ""))[:500]
    return str(body or getattr(exc, "reason", ""))[:500]
