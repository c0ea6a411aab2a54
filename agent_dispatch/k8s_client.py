"""The one Kubernetes credentials lookup, for the operator, the worker's heartbeat and the doctor.

Like :mod:`agent_dispatch.k8s_names` it sits at the bottom of the layer stack and imports nothing
from the package, so every component that talks to the API server finds its credentials the
same way: the pod's ServiceAccount inside a cluster, else a kubeconfig.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def new_api_client(kubeconfig: Path | None = None, *, default_kubeconfig: bool = True) -> Any | None:
    """A kubernetes ``ApiClient``: in a pod its ServiceAccount; else the ``kubeconfig`` file given;
    else, with ``default_kubeconfig``, the client's own default ($KUBECONFIG, then ~/.kube/config).

    ``None`` only without ``default_kubeconfig`` and outside a cluster with no file given: a
    worker on a laptop writes no heartbeat rather than picking up its user's current context.
    """
    from kubernetes import client, config

    # The loaders are untyped; called through Any so strict typing holds with or without stubs.
    load_incluster: Any = config.load_incluster_config
    from_kubeconfig: Any = config.new_client_from_config
    try:
        load_incluster()
        return client.ApiClient()
    except config.ConfigException:
        pass  # not in a pod (no service host or no mounted token): a kubeconfig, if any
    if kubeconfig is not None:
        return from_kubeconfig(config_file=str(kubeconfig), persist_config=False)
    if default_kubeconfig:
        return from_kubeconfig(persist_config=False)
    return None
