"""Pytest fixtures for the loopback Kubernetes control plane and helm (see testenv/kube.py, helm.py).

Register with ``pytest_plugins = ["tests._fixtures.kube"]``.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from testenv.helm import HELM_VERSION, ensure_helm
from testenv.kube import ETCD_VERSION, ControlPlane
from tests._fixtures import USED, start_or_skip


@pytest.fixture(scope="session")
def kube() -> Iterator[ControlPlane]:
    """A running etcd + kube-apiserver (RBAC, admin token) for the whole session."""
    plane = start_or_skip("kube-apiserver", lambda: ControlPlane().start())
    # The session's closing line names each service with its version.
    USED["kube-apiserver"] = f"kube-apiserver {plane.version} (etcd {ETCD_VERSION})"
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kubeconfig(kube: ControlPlane) -> Path:
    """Admin kubeconfig (bearer token, user in system:masters)."""
    return kube.kubeconfig


@pytest.fixture(scope="session")
def kube_api(kube: ControlPlane) -> Iterator[client.ApiClient]:
    """A kubernetes ApiClient authenticated as the admin user."""
    api = config.new_client_from_config(config_file=str(kube.kubeconfig), persist_config=False)
    try:
        yield api
    finally:
        api.close()


def _namespace_name(test_name: str) -> str:
    """A DNS-1123 label naming the test, unique per call (at most 63 characters)."""
    slug = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-")[:40].strip("-") or "test"
    return f"t-{slug}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def kube_namespace(kube_api: client.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards (without waiting for finalization)."""
    core = client.CoreV1Api(kube_api)
    name = _namespace_name(request.node.name)
    core.create_namespace(
        client.V1Namespace(
            metadata=client.V1ObjectMeta(name=name, labels={"agent-dispatch.test/owner": "pytest"})
        )
    )
    try:
        yield name
    finally:
        # Without kube-controller-manager the namespace stays Terminating; names never collide.
        with contextlib.suppress(ApiException):
            core.delete_namespace(name, propagation_policy="Background", _request_timeout=30)


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    """The helm binary built from helm.sh/helm/v4 at the pinned version."""
    helm = start_or_skip("helm", ensure_helm)
    USED["helm"] = f"helm {HELM_VERSION}"
    return helm
