"""Shared helpers for the AgentDispatch tests against the real kube-apiserver (tests/_fixtures/kube.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from agent_dispatch import k8s_names
from testenv._common import free_port
from testenv.kube import ControlPlane
from tests._wait import wait_for

ROOT = Path(__file__).resolve().parents[2]

# The kube fixtures are a plugin (tests/_fixtures/kube.py) that tests/conftest.py registers; until
# it does, register it here so these tests also run on their own, and collect nothing while the
# plugin module itself is absent (it is built in parallel with these tests).
_HAVE_KUBE_FIXTURES = importlib.util.find_spec("tests._fixtures.kube") is not None
collect_ignore_glob = [] if _HAVE_KUBE_FIXTURES else ["test_*.py"]


def pytest_configure(config: pytest.Config) -> None:
    if _HAVE_KUBE_FIXTURES:
        config.pluginmanager.import_plugin("tests._fixtures.kube")  # a no-op when already registered


CRD_FILE = ROOT / "crds" / "agentdispatch.yaml"
CRD_NAME = f"{k8s_names.PLURAL}.{k8s_names.GROUP}"


@pytest.fixture(scope="session")
def agentdispatch_crd(kube: ControlPlane) -> str:
    """The project's CRD, installed with the real kubectl and Established."""
    kube.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    kube.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    # Discovery lags the Established condition by a moment; a get proves the resource is served.
    wait_for(
        lambda: kube.kubectl("get", k8s_names.PLURAL, "-A", check=False).returncode == 0,
        30,
        what="served CRD",
    )
    return CRD_NAME


def kubectl_apply(
    kube: ControlPlane, namespace: str, obj: dict[str, Any], check: bool = True
) -> subprocess.CompletedProcess[str]:
    return kube.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=check)


def agentdispatch(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": k8s_names.API_VERSION,
        "kind": k8s_names.KIND,
        "metadata": {"name": name},
        "spec": spec,
    }


def get_ad(kube_api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    api = client.CustomObjectsApi(kube_api)
    try:
        result: dict[str, Any] = api.get_namespaced_custom_object(
            k8s_names.GROUP, k8s_names.VERSION, namespace, k8s_names.PLURAL, name
        )
    except client.exceptions.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return result


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


class OperatorProcess:
    """``python -m agent_dispatch.cli operator`` against the test kubeconfig, as it runs for real."""

    def __init__(
        self, kube: ControlPlane, namespace: str, log_dir: Path, extra_env: dict[str, str] | None = None
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.log = log_dir / f"operator-{namespace}.log"
        self.port = free_port()
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = {
            **{
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("AGENT_DISPATCH_", "TASK_QUEUE", "STATE_DB"))
            },
            **self.kube.env,
            "AGENT_DISPATCH_METRICS_PORT": "0",
            "AGENT_DISPATCH_LOG_FORMAT": "text",
            "AGENT_DISPATCH_LOG_LEVEL": "INFO",
            **self.extra_env,
        }
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "agent_dispatch.cli",
                    "operator",
                    "-n",
                    self.namespace,
                    "--liveness",
                    f"http://127.0.0.1:{self.port}/healthz",
                ],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_for(self._healthy, 60, what="operator liveness endpoint")
        return self

    def _healthy(self) -> bool:
        import urllib.request

        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def liveness(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=5) as resp:
            data: dict[str, Any] = json.load(resp)
            return data

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


#: KEDA's CRDs ship inside its Go module; the tests install them from the module cache, never
#: from a copy in this repository.
KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_VERSION = "v2.21.0"


def _keda_crd_file() -> Path:
    from testenv._common import ServiceUnavailable, cache_dir, go_env

    try:
        proc = subprocess.run(
            ["go", "mod", "download", "-json", f"{KEDA_MODULE}@{KEDA_VERSION}"],
            cwd=cache_dir("build"),
            env=go_env(),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServiceUnavailable(f"go mod download {KEDA_MODULE}@{KEDA_VERSION}: {exc}") from exc
    if proc.returncode != 0:
        raise ServiceUnavailable(f"go mod download {KEDA_MODULE}@{KEDA_VERSION} failed: {proc.stderr[-500:]}")
    crd = Path(json.loads(proc.stdout)["Dir"]) / "config" / "crd" / "bases" / "keda.sh_scaledobjects.yaml"
    if not crd.is_file():
        raise ServiceUnavailable(f"{KEDA_MODULE}@{KEDA_VERSION} has no ScaledObject CRD")
    return crd


@pytest.fixture(scope="session")
def keda_crd(kube: ControlPlane) -> str:
    """KEDA's own ScaledObject CRD (from its Go module), installed in the test cluster."""
    from tests._fixtures import USED, start_or_skip

    crd = start_or_skip("keda-crds", _keda_crd_file)
    USED["keda-crds"] = f"KEDA CRDs {KEDA_VERSION}"
    kube.kubectl("apply", "--server-side", "-f", str(crd))
    kube.kubectl("wait", "--for=condition=Established", "crd/scaledobjects.keda.sh", "--timeout=60s")
    wait_for(
        lambda: kube.kubectl("get", "scaledobjects", "-A", check=False).returncode == 0, 30, what="KEDA CRD"
    )
    return KEDA_VERSION


@pytest.fixture
def operator_factory(
    kube: ControlPlane, agentdispatch_crd: str, tmp_path: Path
) -> Iterator[Callable[..., OperatorProcess]]:
    started: list[OperatorProcess] = []

    def start(namespace: str, **env: str) -> OperatorProcess:
        proc = OperatorProcess(kube, namespace, tmp_path, env).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
