"""The README's Kubernetes section is what this test runs: every command of its bash block, in order,
against the real kube-apiserver (helm and kubectl built from their Go modules)."""

from __future__ import annotations

import re
import shlex
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from testenv.helm import run_helm
from testenv.kube import ControlPlane
from tests.helm._support import CRD_NAME, RELEASE, ROOT, ChartOperator, crd_established, leftovers, wait_for

pytestmark = pytest.mark.kube

MARKER = "<!-- The block below is run, command by command, by tests/helm/test_readme.py. -->"
README_NAMESPACE = "agent-dispatch"


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index(MARKER)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.DOTALL)
    assert block is not None, "the README's Kubernetes section lost its bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_the_block_is_the_walkthrough_the_issue_asks_for() -> None:
    commands = readme_commands()
    tools = [shlex.split(c)[:2] for c in commands]
    assert tools[0] == ["helm", "install"]
    assert ["kubectl", "-n"] in tools
    assert any(" apply -f examples/" in c for c in commands)
    assert any(" get agentdispatch" in c for c in commands)
    assert tools[-1] == ["helm", "uninstall"]


def _localise(args: list[str], namespace: str) -> list[str]:
    """The README's namespace becomes a fresh one; relative paths become absolute (any cwd works)."""
    out: list[str] = []
    for index, arg in enumerate(args):
        if index > 0 and args[index - 1] in {"-n", "--namespace"} and arg == README_NAMESPACE:
            out.append(namespace)
        elif not arg.startswith("-") and "/" in arg and (ROOT / arg).exists():
            out.append(str(ROOT / arg))
        else:
            out.append(arg)
    return out


def test_readme_kubernetes_section_runs(
    helm_bin: Path, kube: ControlPlane, kube_api: client.ApiClient, tmp_path: Path
) -> None:
    namespace = f"readme-{uuid.uuid4().hex[:6]}"
    outputs: dict[str, str] = {}
    operator: ChartOperator | None = None
    try:
        for command in readme_commands():
            tool, *args = _localise(shlex.split(command), namespace)
            if tool == "helm":
                proc = run_helm(
                    *args, helm=helm_bin, home=tmp_path / "helm", kubeconfig=kube.kubeconfig, timeout=180
                )
            else:
                assert tool == "kubectl", command
                proc = kube.kubectl(*args, timeout=180)
            outputs[command] = proc.stdout
            if args[:1] == ["install"]:
                # There is no kubelet here: the test runs the operator Deployment's command with its
                # ServiceAccount's own token, as the pod would.
                crd_established(kube)
                operator = ChartOperator(kube, kube_api, namespace, tmp_path).start()
    finally:
        if operator is not None:
            operator.stop()

    listing = next(out for cmd, out in outputs.items() if cmd.endswith("get agentdispatch"))
    assert re.search(r"^example\s+sqlite\s", listing, re.MULTILINE), listing
    objects = next(out for cmd, out in outputs.items() if "get deployment,service" in cmd)
    assert "deployment.apps/example-worker" in objects or "example-worker" in objects
    assert "service/example-worker" in objects
    assert f'release "{RELEASE}" uninstalled' in next(
        out for cmd, out in outputs.items() if "uninstall" in cmd
    )
    # With kube-controller-manager running, ReplicaSets and Pods go by garbage collection: wait.
    wait_for(lambda: leftovers(kube, namespace) == [], 60, what=f"no leftovers in {namespace}")
    assert (
        client.ApiextensionsV1Api(kube_api).read_custom_resource_definition(CRD_NAME).metadata.name
        == CRD_NAME
    )
    assert operator is not None and operator.forbidden() == [], operator.tail() if operator else ""
