"""``agent-dispatch operator`` / ``agent-dispatch-operator``: run kopf in this process.

Settings come from the settings module (log level and format, the metrics port), so a bad
variable stops the operator with exit code 2 like every other entry point.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import kopf

from agent_dispatch import _logging
from agent_dispatch.settings import load_or_exit


def scope_of(namespaces: Sequence[str], all_namespaces: bool) -> tuple[bool, list[str]]:
    """(clusterwide, namespaces): with neither option the operator watches every namespace."""
    if all_namespaces or not namespaces:
        return True, []
    return False, list(namespaces)


def main(args: argparse.Namespace) -> int:
    settings = load_or_exit("agent-dispatch operator")
    _logging.configure(settings.log_level, settings.log_format.value)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port)
    from agent_dispatch.operator.handlers import REGISTRY

    clusterwide, namespaces = scope_of(args.namespace, args.all_namespaces)
    kopf.run(
        registry=REGISTRY,
        # Standalone: one replica (the chart's Deployment uses Recreate), so no peering objects
        # and no extra RBAC for kopf's peering resources.
        standalone=True,
        clusterwide=clusterwide,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
        # Exact namespace names need no cluster-wide scanning; globs and -A do.
        memo=kopf.Memo(scan_cluster=clusterwide or any(set("*?[") & set(ns) for ns in namespaces)),
    )
    return 0
