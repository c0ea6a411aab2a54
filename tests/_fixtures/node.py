"""Pytest plugin: a real single-node cluster (testenv/node.py) where the project's image runs as pods.

One node per session, started by the first test that asks for it; the helm binary comes from
tests/_fixtures/kube.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client, config

from testenv.kube import KUBERNETES_VERSION
from testenv.node import NodeCluster
from tests._fixtures import USED, start_or_skip


@pytest.fixture(scope="session")
def node() -> Iterator[NodeCluster]:
    """The node cluster: control plane, kubelet, kube-proxy, containerd, the image imported."""
    cluster = NodeCluster()
    try:
        start_or_skip("node", cluster.start)
        USED["node"] = f"node (kubelet {KUBERNETES_VERSION}, containerd, image {cluster.images.app_ref})"
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def node_api(node: NodeCluster) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=str(node.kubeconfig), persist_config=False)
    try:
        yield api
    finally:
        api.close()
