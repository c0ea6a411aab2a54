"""Helpers for the Helm chart tests: rendering, installing, the operator as the chart runs it, and
SubjectAccessReviews for the chart's ServiceAccounts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from testenv._common import free_port
from testenv.helm import run_helm
from testenv.kube import ControlPlane
from tests._wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "agent-dispatch"
CRD_FILE = ROOT / "crds" / "agentdispatch.yaml"
CRD_NAME = "agentdispatches.agentdispatch.io"
GROUP, VERSION, PLURAL = "agentdispatch.io", "v1alpha1", "agentdispatches"
#: The release name the README uses; a release whose name contains the chart name is its full name.
RELEASE = "agent-dispatch"

#: kopf's start-up scan in namespaced mode: it tries to list namespaces and CRDs (both cluster-scoped,
#: so a Role cannot grant them), retries, then falls back to the namespaces it was given and logs a
#: warning. Expected, not an RBAC gap of the chart (see docs/operations.md on kopf's scanning).
EXPECTED_FORBIDDEN = re.compile(
    r'cannot (list|watch) resource \\?"(namespaces|customresourcedefinitions)\\?" in API group '
    r'\\?"[a-z0-9.]*\\?" at the cluster scope'
    r"|Not enough permissions to (list namespaces|watch for namespaces|watch for resources)"
)


def manifests(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc.get("kind") == kind]


def render(
    helm_bin: Path, home: Path, namespace: str, *args: str, release: str = RELEASE, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart (extra args: --set, -f, --api-versions, ...)."""
    return run_helm(
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        *args,
        helm=helm_bin,
        home=home,
        check=check,
    )


def helm(
    helm_bin: Path, home: Path, kube: ControlPlane, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """helm against the test API server as the admin (who installs charts in real life)."""
    return run_helm(*args, helm=helm_bin, home=home, kubeconfig=kube.kubeconfig, check=check, timeout=180)


def crd_established(kube: ControlPlane) -> None:
    kube.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    wait_for(
        lambda: kube.kubectl("get", PLURAL, "-A", check=False).returncode == 0,
        30,
        what="the AgentDispatch resource served",
    )


def get_ad(kube_api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        result: dict[str, Any] = client.CustomObjectsApi(kube_api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return result


def get_deployment(kube_api: client.ApiClient, namespace: str, name: str) -> Any | None:
    try:
        return client.AppsV1Api(kube_api).read_namespaced_deployment(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def service_account_token(kube_api: client.ApiClient, namespace: str, name: str) -> str:
    """A bound token for ServiceAccount ``name`` from the TokenRequest API (what a pod mounts)."""
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
    )
    response = client.CoreV1Api(kube_api).create_namespaced_service_account_token(name, namespace, request)
    return str(response.status.token)


def service_account_user(namespace: str, name: str) -> tuple[str, list[str]]:
    """The user name and groups the API server gives a ServiceAccount token."""
    return (
        f"system:serviceaccount:{namespace}:{name}",
        ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
    )


def can(
    kube_api: client.ApiClient,
    subject: tuple[str, list[str]],
    verb: str,
    resource: str,
    *,
    group: str = "",
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> bool:
    """A SubjectAccessReview: may ``subject`` do ``verb`` on ``resource``?"""
    user, groups = subject
    attributes = client.V1ResourceAttributes(
        verb=verb, resource=resource, group=group, namespace=namespace, name=name, subresource=subresource
    )
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(user=user, groups=groups, resource_attributes=attributes)
    )
    result = client.AuthorizationV1Api(kube_api).create_subject_access_review(review)
    return bool(result.status.allowed)


def _entry_point(command: Sequence[str]) -> list[str]:
    """The chart's container command, resolved to this test environment's installed scripts."""
    name, rest = command[0], list(command[1:])
    for candidate in (Path(sys.executable).parent / name, shutil.which(name)):
        if candidate and Path(candidate).is_file():
            return [str(candidate), *rest]
    modules = {
        "agent-dispatch-operator": ["operator"],
        "agent-dispatch-worker": ["worker"],
        "agent-dispatch": [],
    }
    return [sys.executable, "-m", "agent_dispatch.cli", *modules[name], *rest]


class ChartOperator:
    """The operator exactly as the chart's Deployment runs it, with that pod's identity.

    There is no kubelet here, so the test plays it: it reads the installed Deployment's command,
    arguments and environment, asks the TokenRequest API for a token of the Deployment's
    ServiceAccount, and runs the command as a subprocess with a kubeconfig holding only that
    token. The liveness address moves to a free loopback port.
    """

    def __init__(
        self,
        kube: ControlPlane,
        kube_api: client.ApiClient,
        namespace: str,
        log_dir: Path,
        deployment: str = f"{RELEASE}-operator",
    ) -> None:
        self.kube = kube
        self.kube_api = kube_api
        self.namespace = namespace
        self.deployment = deployment
        self.log = log_dir / f"operator-{namespace}-{deployment}-{uuid.uuid4().hex[:6]}.log"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.argv: list[str] = []
        self.service_account = ""

    def _command(self) -> tuple[list[str], dict[str, str]]:
        dep = client.AppsV1Api(self.kube_api).read_namespaced_deployment(self.deployment, self.namespace)
        pod = dep.spec.template.spec
        self.service_account = pod.service_account_name
        container = pod.containers[0]
        args = [
            f"--liveness=http://127.0.0.1:{self.port}/healthz" if arg.startswith("--liveness=") else arg
            for arg in (container.args or [])
        ]
        env = {item.name: item.value for item in container.env or [] if item.value is not None}
        # Metrics on a free port: several operators may run in one test session.
        env["AGENT_DISPATCH_METRICS_PORT"] = str(free_port())
        return [*_entry_point(container.command), *args], env

    def start(self) -> ChartOperator:
        argv, pod_env = self._command()
        token = service_account_token(self.kube_api, self.namespace, self.service_account)
        kubeconfig = self.kube.kubeconfig_for_token(token, f"{self.namespace}-{self.service_account}")
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AGENT_DISPATCH_", "TASK_QUEUE", "STATE_DB", "KUBERNETES_", "KAFKA_"))
        }
        env.update(pod_env)
        env["KUBECONFIG"] = str(kubeconfig)
        env["HOME"] = str(self.log.parent)
        self.argv = argv
        with self.log.open("ab") as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        wait_for(self._healthy, 60, what=f"operator liveness endpoint\n{self.tail()}")
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def forbidden(self, about: Sequence[str] = ()) -> list[str]:
        """Log lines reporting a permission error, except kopf's expected fallbacks; with ``about``,
        only lines naming one of those strings (a cluster-wide operator also meets objects that
        other tests of the session left in their namespaces)."""
        return [
            line
            for line in self.text().splitlines()
            # Not a bare "403": log timestamps carry milliseconds such as "24.403".
            if re.search(r"forbidden|status\W{0,3}403\b|\b403 \w", line, re.IGNORECASE)
            and not EXPECTED_FORBIDDEN.search(line)
            and (not about or any(text in line for text in about))
        ]


def leftovers(kube: ControlPlane, namespace: str) -> list[str]:
    """Objects in ``namespace`` (and cluster-scoped ones) that the chart or the operator made."""
    found: list[str] = []
    namespaced = (
        "deployments,replicasets,pods,services,serviceaccounts,roles,rolebindings,configmaps,"
        "secrets,leases,horizontalpodautoscalers,agentdispatches"
    )
    for selector in (
        f"app.kubernetes.io/instance={RELEASE}",
        "app.kubernetes.io/managed-by=agent-dispatch-operator",
        "agent-dispatch.io/instance",
        "app.kubernetes.io/name=agent-dispatch",
    ):
        out = kube.kubectl("get", namespaced, "-n", namespace, "-l", selector, "-o", "name").stdout
        found += out.split()
        out = kube.kubectl("get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "name").stdout
        found += [name for name in out.split() if RELEASE in name]
    found += kube.kubectl("get", "agentdispatches", "-n", namespace, "-o", "name").stdout.split()
    return sorted(set(found))
