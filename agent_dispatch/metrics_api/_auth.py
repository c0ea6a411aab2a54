"""Who is calling, and may they: the delegated authentication and authorization an aggregated API
server owes the cluster.

Authentication follows kube-apiserver's front-proxy contract: the aggregator connects with a
client certificate signed by the *requestheader client CA* and whose common name is one of the
*allowed names*; only then are the user and groups in the request headers (names given by the
``extension-apiserver-authentication`` ConfigMap in kube-system) believed. A caller without that
certificate may still present a bearer token, checked with a TokenReview. Anything else is 401.
Authorization is one SubjectAccessReview per request, with the attributes the API server itself
would use for ``GET /apis/external.metrics.k8s.io/v1beta1/namespaces/<ns>/<metric>``.
"""

from __future__ import annotations

import json
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from agent_dispatch.metrics_api import _api

AUTH_CONFIGMAP_NAMESPACE: Final = "kube-system"
AUTH_CONFIGMAP_NAME: Final = "extension-apiserver-authentication"


@dataclass(frozen=True)
class RequestHeaderConfig:
    """The front proxy's contract, from the ConfigMap the API server publishes."""

    client_ca: str  # PEM bundle
    allowed_names: tuple[str, ...] = ()
    username_headers: tuple[str, ...] = ("X-Remote-User",)
    group_headers: tuple[str, ...] = ("X-Remote-Group",)
    extra_prefixes: tuple[str, ...] = ("X-Remote-Extra-",)


def _json_list(value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        return default
    try:
        parsed = json.loads(value)
    except ValueError:
        return default
    return tuple(str(v) for v in parsed) if isinstance(parsed, list) else default


def requestheader_config(data: Mapping[str, str] | None) -> RequestHeaderConfig | None:
    """From the ConfigMap's data; None when the API server has no front proxy configured (then no
    aggregated API can authenticate the aggregator, and this server refuses to start)."""
    if not data or not data.get("requestheader-client-ca-file"):
        return None
    return RequestHeaderConfig(
        client_ca=data["requestheader-client-ca-file"],
        # An empty list means "any certificate the CA signed", as in kube-apiserver.
        allowed_names=_json_list(data.get("requestheader-allowed-names"), ()),
        username_headers=_json_list(data.get("requestheader-username-headers"), ("X-Remote-User",)),
        group_headers=_json_list(data.get("requestheader-group-headers"), ("X-Remote-Group",)),
        extra_prefixes=_json_list(data.get("requestheader-extra-headers-prefix"), ("X-Remote-Extra-",)),
    )


def server_context(cert_file: str, key_file: str, client_ca: str) -> ssl.SSLContext:
    """TLS for the aggregator: our serving certificate, and client certificates *optional* but
    verified against the requestheader CA when presented (a caller with a token and no
    certificate must still get through the handshake to be told 401 or be reviewed)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    context.verify_mode = ssl.CERT_OPTIONAL
    context.load_verify_locations(cadata=client_ca)
    return context


def common_name(peercert: Mapping[str, Any] | None) -> str | None:
    """The CN of a certificate the TLS layer verified (``SSLSocket.getpeercert()`` form)."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    uid: str = ""


class Unauthenticated(Exception):
    """401: who is calling is unknown."""


def _first(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return None


def front_proxy_user(
    config: RequestHeaderConfig, peercert: Mapping[str, Any] | None, headers: Any
) -> User | None:
    """The user the front proxy vouches for, or None when the caller is not the front proxy.

    ``peercert`` is only non-empty when the TLS layer verified the certificate against the
    requestheader CA; ``headers`` is a multidict (aiohttp's CIMultiDictProxy: case-insensitive,
    repeated headers kept) so several ``X-Remote-Group`` lines all count."""
    name = common_name(peercert)
    if name is None:
        return None
    if config.allowed_names and name not in config.allowed_names:
        raise Unauthenticated(f"client certificate CN {name!r} is not an allowed front-proxy name")
    user = _first(headers, config.username_headers)
    if not user:
        raise Unauthenticated("front-proxy request without a user header")
    groups = tuple(g for h in config.group_headers for g in headers.getall(h, ()) if g)
    extra: dict[str, list[str]] = {}
    for prefix in config.extra_prefixes:
        for key, value in headers.items():
            if key.lower().startswith(prefix.lower()):
                extra_key = urllib.parse.unquote(key[len(prefix) :]).lower()
                extra.setdefault(extra_key, []).append(value)
    return User(user, groups, {k: tuple(v) for k, v in extra.items()})


def bearer_token(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


# --- the two reviews (blocking kubernetes client calls; run in a thread) ---------------------------


def token_review(api_client: Any, token: str) -> User:
    from kubernetes import client

    review = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token))
    result = client.AuthenticationV1Api(api_client).create_token_review(review)
    st = result.status
    if not st or not st.authenticated or not st.user:
        raise Unauthenticated("the bearer token was not accepted by the API server")
    extra = {k: tuple(v or ()) for k, v in (st.user.extra or {}).items()}
    return User(st.user.username or "", tuple(st.user.groups or ()), extra, st.user.uid or "")


def access_review_body(user: User, namespace: str, metric: str) -> dict[str, Any]:
    """The SubjectAccessReview for reading ``metric`` in ``namespace``. A GET on the collection
    path is verb ``list`` in the API server's request info, with the metric as the resource."""
    spec: dict[str, Any] = {
        "user": user.name,
        "groups": list(user.groups),
        "resourceAttributes": {
            "verb": "list",
            "group": _api.GROUP,
            "version": _api.VERSION,
            "resource": metric,
            "namespace": namespace,
        },
    }
    if user.extra:
        spec["extra"] = {k: list(v) for k, v in user.extra.items()}
    if user.uid:
        spec["uid"] = user.uid
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}


def access_review(api_client: Any, user: User, namespace: str, metric: str) -> tuple[bool, str]:
    """(allowed, reason) from the API server's authorizer."""
    from kubernetes import client

    body = access_review_body(user, namespace, metric)
    result = client.AuthorizationV1Api(api_client).create_subject_access_review(body)
    st = result.status
    return bool(st and st.allowed), str((st.reason if st else "") or "")
