"""The README's Kubernetes block, verbatim, on a real node: the chart's operator runs as a pod under
its ServiceAccount, the example's worker pods become Ready, and their Leases show in .status."""

from __future__ import annotations

import contextlib
import re
import shlex
from pathlib import Path

import pytest

from testenv.helm import run_helm
from testenv.node import NodeCluster
from tests.helm._support import CRD_NAME, RELEASE, wait_for
from tests.helm.test_readme import README_NAMESPACE, localise, readme_commands
from tests.node._support import describe, forbidden_lines, pods, ready, restarts, seconds_to_ready

pytestmark = pytest.mark.node


def test_readme_kubernetes_section_runs_on_a_node(helm_bin: Path, node: NodeCluster, tmp_path: Path) -> None:
    namespace = README_NAMESPACE
    outputs: dict[str, str] = {}
    operator_log = ""
    for command in readme_commands():
        tool, *args = localise(shlex.split(command), namespace)
        if tool == "helm" and args[:1] == ["uninstall"]:
            # Before the operator goes: its pod must be healthy and its log clean.
            (operator,) = pods(node, namespace, "app.kubernetes.io/component=operator")
            assert ready(operator) and restarts(operator) == 0, describe(node, namespace)
            operator_log = node.kubectl("logs", "-n", namespace, operator["metadata"]["name"]).stdout
            workers = pods(node, namespace, "agent-dispatch.io/instance=example")
            assert workers == [] or all(p["metadata"].get("deletionTimestamp") for p in workers)
        if tool == "helm":
            proc = run_helm(
                *args, helm=helm_bin, home=tmp_path / "helm", kubeconfig=node.kubeconfig, timeout=300
            )
        else:
            assert tool == "kubectl", command
            proc = node.kubectl(*args, timeout=300, check=False)
            assert proc.returncode == 0, f"{command}\n{proc.stdout}{proc.stderr}\n{describe(node, namespace)}"
        outputs[command] = proc.stdout
        if "rollout status" in command:
            workers = pods(node, namespace, "agent-dispatch.io/instance=example")
            assert len(workers) == 1 and ready(workers[0]), describe(node, namespace)
            assert workers[0]["spec"]["containers"][0]["image"] == node.images.app_ref
            print(f"worker pod creation to Ready: {seconds_to_ready(workers[0]):.0f}s")

    listing = next(out for cmd, out in outputs.items() if cmd.endswith("get agentdispatch"))
    # NAME BACKEND DEPTH WORKERS READY AGE: one live worker, from its pod's Lease (no depth: SQLite is per pod).
    assert re.search(r"^example\s+sqlite\s+(\d+\s+)?1\s+True\s", listing, re.MULTILINE), listing
    assert forbidden_lines(operator_log) == [], operator_log[-3000:]
    assert f'release "{RELEASE}" uninstalled' in next(
        out for cmd, out in outputs.items() if "uninstall" in cmd
    )

    def left() -> list[str]:
        kinds = "all,serviceaccounts,roles,rolebindings,leases,secrets,configmaps,agentdispatches"
        names = node.kubectl("get", kinds, "-n", namespace, "-o", "name").stdout.split()
        return [n for n in names if n not in {"serviceaccount/default", "configmap/kube-root-ca.crt"}]

    with contextlib.suppress(AssertionError):
        wait_for(lambda: left() == [], 120, what=f"nothing but the CRD left in {namespace}")
    assert left() == [], describe(node, namespace)
    assert node.kubectl("get", "crd", CRD_NAME, "-o", "name").stdout.strip().endswith(CRD_NAME)
