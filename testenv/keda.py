"""KEDA for tests: its operator and metrics adapter built from KEDA's Go module, run against a node.

KEDA v2.21.1 declares ``go 1.27.4``, newer than this machine's Go and than the toolchain the
module proxy approves (go1.27.3), so the newest release that builds here, v2.21.0 (``go 1.26.0``),
is used. The programs run as host processes inside the node's network namespace (as real as pods,
and without building KEDA's images); the adapter is registered as ``v1beta1.external.metrics.k8s.io``
through a selector-less Service whose EndpointSlice names the namespace's own address.

Both programs run as KEDA's own identity, not as the cluster admin: the ServiceAccount
``keda/keda-operator`` and the RBAC that KEDA's release ships for it (``config/service_account``,
``config/rbac`` and ``config/metrics-server`` of the module, applied as they are), with a token from
the TokenRequest API. A permission KEDA's manifests do not grant is therefore missing here too.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from testenv._common import (
    ServiceUnavailable,
    cache_dir,
    go_env,
    log_tail,
    progress,
    stop_process,
    wait_until,
)
from testenv.kube import _download_module, bin_path, build_go_programs
from testenv.node import NodeCluster
from testenv.pki import CertificateAuthority

KEDA_VERSION = "v2.21.0"
KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_PROGRAMS = {
    "keda": f"{KEDA_MODULE}/cmd/operator",
    "keda-adapter": f"{KEDA_MODULE}/cmd/adapter",
}


def _module_directives(keda_go_mod: str) -> str:
    """KEDA's own ``replace``/``exclude`` directives, which a module that merely requires KEDA does not
    inherit: without them the build resolves different (for nexus-proto-annotations, unlicensed)
    versions than KEDA's release was built and tested with."""
    lines: list[str] = []
    block: str | None = None  # the verb of the ``replace (`` / ``exclude (`` block being read
    for raw in keda_go_mod.splitlines():
        line = raw.split("//", 1)[0].strip()
        if block is not None:
            if line == ")":
                block = None
            elif line:
                lines.append(f"{block} {line}")
            continue
        match = re.match(r"^(replace|exclude)\s*(\(?)\s*(.*)$", line)
        if match is None:
            continue
        if match.group(2):
            block = match.group(1)
        else:
            lines.append(f"{match.group(1)} {match.group(3)}")
    return "".join(f"{line}\n" for line in lines)


def keda_module_dir() -> Path:
    """The unpacked KEDA module (sources, config/crd/bases) in the Go module cache."""
    info = _download_module(
        KEDA_MODULE, KEDA_VERSION, env=go_env(), log=cache_dir("build", f"keda-{KEDA_VERSION}") / "build.log"
    )
    directory = Path(str(info.get("Dir", "")))
    if not directory.is_dir():
        raise ServiceUnavailable(f"{KEDA_MODULE}@{KEDA_VERSION} has no unpacked directory: {info}")
    return directory


def ensure_keda() -> dict[str, Path]:
    """Build (once) and return KEDA's operator (``keda``) and metrics adapter (``keda-adapter``)."""
    outputs = {name: bin_path(name, KEDA_VERSION) for name in KEDA_PROGRAMS}
    if all(path.is_file() for path in outputs.values()):
        return outputs
    key = f"keda-{KEDA_VERSION}"
    info = _download_module(
        KEDA_MODULE, KEDA_VERSION, env=go_env(), log=cache_dir("build", key) / "build.log"
    )
    commit = str(json.loads(Path(info["Info"]).read_text()).get("Origin", {}).get("Hash", ""))
    build_go_programs(
        key=key,
        module=KEDA_MODULE,
        version=KEDA_VERSION,
        programs=KEDA_PROGRAMS,
        # What KEDA's Makefile stamps: the version and commit the operator logs at start.
        ldflags=[
            "-s",
            "-w",
            f"-X {KEDA_MODULE}/version.Version={KEDA_VERSION.removeprefix('v')}",
            f"-X {KEDA_MODULE}/version.GitCommit={commit}",
        ],
        outputs=outputs,
        extra_go_mod="\n" + _module_directives(Path(info["GoMod"]).read_text()),
    )
    return outputs


# --------------------------------------------------------------------------------------------------
# Running KEDA against a node cluster
# --------------------------------------------------------------------------------------------------

KEDA_NAMESPACE = "keda"
APISERVICE = "v1beta1.external.metrics.k8s.io"
ADAPTER_SERVICE = "keda-metrics-apiserver"
OPERATOR_SERVICE = "keda-operator"
# Ports inside the node's network namespace, which nothing else there uses (one node at a time).
ADAPTER_SECURE_PORT = 16443
ADAPTER_METRICS_PORT = 18080
OPERATOR_GRPC_PORT = 19666
OPERATOR_PROBE_PORT = 18081
OPERATOR_METRICS_PORT = 18082
START_TIMEOUT_S = 180.0


#: KEDA's manifests (module paths) that create its ServiceAccount and bind it to KEDA's roles: the
#: operator's ClusterRole/Role, the metrics server's auth-delegator and authentication-reader
#: bindings, and the external-metrics reader for the HPA controller. Their namespace is "keda".
KEDA_RBAC_MANIFESTS = (
    "config/service_account/service_account.yaml",
    "config/rbac/role.yaml",
    "config/rbac/role_binding.yaml",
    "config/rbac/aggregate_cluster_roles.yaml",
    "config/metrics-server/role.yaml",
    "config/metrics-server/role_binding.yaml",
)
#: The identity both programs run as (KEDA's Deployments both name this ServiceAccount).
KEDA_SERVICE_ACCOUNT = "keda-operator"
#: The token outlives any test session; the TokenRequest API may shorten it (then it says so).
KEDA_TOKEN_DURATION = "12h"


def keda_rbac_manifests() -> list[Path]:
    """KEDA's ServiceAccount and RBAC manifests, as its release ships them."""
    root = keda_module_dir()
    paths = [root / name for name in KEDA_RBAC_MANIFESTS]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise ServiceUnavailable(f"{KEDA_MODULE}@{KEDA_VERSION} lacks {missing}")
    return paths


def keda_crds() -> list[Path]:
    """KEDA's CRDs as its release ships them (config/crd/bases of the module)."""
    crds = sorted((keda_module_dir() / "config" / "crd" / "bases").glob("*.yaml"))
    if not crds:
        raise ServiceUnavailable(f"no CRDs under config/crd/bases of {KEDA_MODULE}@{KEDA_VERSION}")
    return crds


class KedaRunner:
    """KEDA's operator and metrics adapter as processes in ``node``'s network namespace.

    ``start()`` installs KEDA's CRDs, starts both programs with certificates of a throwaway CA
    (the operator's gRPC metrics service and the adapter talk mutual TLS, as in KEDA's release), and
    registers the adapter as the cluster's external metrics API; an APIService of that name that
    existed before (the chart's own metrics API) is put back by ``stop()``.
    """

    def __init__(self, node: NodeCluster) -> None:
        self.node = node
        self.workdir = Path(tempfile.mkdtemp(prefix="agent-dispatch-keda-"))
        self.cert_dir = self.workdir / "certs"
        self.log_dir = self.workdir / "logs"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._displaced_apiservice: dict[str, Any] | None = None
        self._stopped = False
        self._rbac_applied = False
        self.timings: dict[str, float] = {}
        #: The kubeconfig both programs use: KEDA's ServiceAccount token (set by ``start()``).
        self.kubeconfig: Path | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> KedaRunner:
        started = time.monotonic()
        atexit.register(self.stop)
        try:
            binaries = ensure_keda()
            self.timings["build_s"] = time.monotonic() - started
            mark = time.monotonic()
            self._install_crds()
            self._install_identity()
            self._issue_certificates()
            self._start_operator(binaries["keda"])
            self._start_adapter(binaries["keda-adapter"])
            self._register_apiservice()
            self.timings["start_s"] = time.monotonic() - mark
        except BaseException:
            self.stop()
            raise
        progress(f"KEDA {KEDA_VERSION} running against the node in {time.monotonic() - started:.0f}s")
        return self

    def stop(self) -> None:
        """Remove what KEDA owns in the cluster (its finalizers need the operator), stop both
        programs, and give the external metrics API back to whoever had it."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        operator = self._procs.get("keda-operator")
        if operator is not None and operator.poll() is None:
            # ScaledObjects carry KEDA's finalizer: deleted without the operator they would hang
            # (and their namespace with them).
            self._kubectl(
                "delete", "scaledobjects.keda.sh", "--all", "--all-namespaces", "--wait=true", "--timeout=60s"
            )
        self._kubectl("delete", "apiservice", APISERVICE, "--ignore-not-found", "--wait=true")
        if self._displaced_apiservice is not None:
            self._kubectl("create", "-f", "-", input=json.dumps(self._displaced_apiservice))
        for name in ("keda-adapter", "keda-operator"):
            stop_process(self._procs.get(name), timeout=20)
        if self._rbac_applied:
            # Cluster-scoped roles and bindings (and the one in kube-system) outlive the namespace.
            for manifest in reversed(keda_rbac_manifests()):
                self._kubectl("delete", "-f", str(manifest), "--ignore-not-found", "--wait=false")
        self._kubectl("delete", "namespace", KEDA_NAMESPACE, "--ignore-not-found", "--wait=false")
        if not os.environ.get("AGENT_DISPATCH_KEEP_KUBE"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, name: str, lines: int = 40) -> str:
        return log_tail(self.log_dir / f"{name}.log", lines)

    # -- steps -------------------------------------------------------------------------------------

    def _kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        # Clean-up calls: a failure is reported by what the tests then find, never raised here.
        return self.node.kubectl(*args, input=input, check=False, timeout=120)

    def _install_crds(self) -> None:
        crds = keda_crds()
        for crd in crds:
            # Server-side: the ScaledJob CRD is larger than the client-side apply annotation allows.
            self.node.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd), timeout=120)
        names = [str(yaml.safe_load(crd.read_text())["metadata"]["name"]) for crd in crds]
        self.node.kubectl(
            "wait",
            "--for=condition=Established",
            *[f"crd/{name}" for name in names],
            "--timeout=60s",
            timeout=90,
        )
        self.node.kubectl("create", "namespace", KEDA_NAMESPACE, check=False)

    def _install_identity(self) -> None:
        """KEDA's ServiceAccount bound to KEDA's roles, and a kubeconfig with a token for it."""
        self._rbac_applied = True
        for manifest in keda_rbac_manifests():
            self.node.kubectl("apply", "-f", str(manifest), timeout=120)
        token = self.node.kubectl(
            "create",
            "token",
            KEDA_SERVICE_ACCOUNT,
            "-n",
            KEDA_NAMESPACE,
            f"--duration={KEDA_TOKEN_DURATION}",
        ).stdout.strip()
        assert self.node.plane is not None
        self.kubeconfig = self.node.plane.kubeconfig_for_token(
            token, f"system:serviceaccount:{KEDA_NAMESPACE}:{KEDA_SERVICE_ACCOUNT}"
        )

    def _issue_certificates(self) -> None:
        """One CA and one certificate for both programs, as KEDA's own cert rotation issues it:
        the operator serves gRPC with it, the adapter presents it as the gRPC client and serves
        the external metrics API with it."""
        (self.workdir / "custom-ca").mkdir(parents=True, exist_ok=True)
        ca = CertificateAuthority(self.cert_dir, "ca")
        services = [
            f"{service}.{KEDA_NAMESPACE}.svc{suffix}"
            for service in (OPERATOR_SERVICE, ADAPTER_SERVICE)
            for suffix in ("", ".cluster.local")
        ]
        ca.issue(
            "tls",
            OPERATOR_SERVICE,
            sans=(self.node.node_ip, "127.0.0.1", *services),
            server=True,
            client=True,
        )
        self.ca_bundle = ca.cert.read_bytes()

    def _env(self) -> dict[str, str]:
        assert self.kubeconfig is not None, "start() makes KEDA's kubeconfig first"
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "POD_NAMESPACE": KEDA_NAMESPACE,
            "KEDA_CLUSTER_OBJECT_NAMESPACE": KEDA_NAMESPACE,
            "WATCH_NAMESPACE": "",
        }

    def _spawn(self, name: str, cmd: Sequence[str | os.PathLike[str]]) -> subprocess.Popen[bytes]:
        log = self.log_dir / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            out.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                self.node.network.wrap(cmd),
                env=self._env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._procs[name] = proc
        return proc

    def _probe(self, url: str) -> bool:
        probe = f"import urllib.request; urllib.request.urlopen({url!r}, timeout=2)"
        self.node.network.exec(sys.executable, "-c", probe, timeout=10)
        return True

    def _start_operator(self, binary: Path) -> None:
        node_ip = self.node.node_ip
        proc = self._spawn(
            "keda-operator",
            [
                binary,
                "--zap-log-level=info",
                "--zap-encoder=console",
                f"--metrics-bind-address=127.0.0.1:{OPERATOR_METRICS_PORT}",
                f"--health-probe-bind-address=127.0.0.1:{OPERATOR_PROBE_PORT}",
                f"--metrics-service-bind-address={node_ip}:{OPERATOR_GRPC_PORT}",
                f"--cert-dir={self.cert_dir}",
                # Scalers trust the system's CAs plus these (none: our servers speak plain TCP).
                f"--ca-dir={self.workdir / 'custom-ca'}",
                # The certificates are this runner's; KEDA must not generate its own or patch ours.
                "--enable-cert-rotation=false",
            ],
        )
        wait_until(
            lambda: self._probe(f"http://127.0.0.1:{OPERATOR_PROBE_PORT}/readyz"),
            timeout=START_TIMEOUT_S,
            what="keda-operator",
            log=self.log_dir / "keda-operator.log",
            proc=proc,
            interval=1,
        )

    def _start_adapter(self, binary: Path) -> None:
        node_ip = self.node.node_ip
        kubeconfig = str(self.kubeconfig)
        proc = self._spawn(
            "keda-adapter",
            [
                binary,
                "--zap-log-level=info",
                f"--bind-address={node_ip}",
                f"--secure-port={ADAPTER_SECURE_PORT}",
                f"--tls-cert-file={self.cert_dir / 'tls.crt'}",
                f"--tls-private-key-file={self.cert_dir / 'tls.key'}",
                f"--cert-dir={self.cert_dir}",
                f"--port={ADAPTER_METRICS_PORT}",
                f"--metrics-service-address={node_ip}:{OPERATOR_GRPC_PORT}",
                # Delegated authentication and authorization as in a cluster: the front proxy's CA
                # and allowed names come from kube-system/extension-apiserver-authentication, callers
                # are checked with TokenReview and SubjectAccessReview.
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--lister-kubeconfig={kubeconfig}",
            ],
        )
        wait_until(
            lambda: self._probe_tls(f"https://{node_ip}:{ADAPTER_SECURE_PORT}/healthz"),
            timeout=START_TIMEOUT_S,
            what="keda-adapter",
            log=self.log_dir / "keda-adapter.log",
            proc=proc,
            interval=1,
        )

    def _probe_tls(self, url: str) -> bool:
        probe = (
            "import ssl, urllib.request; "
            f"ctx = ssl.create_default_context(cafile={str(self.cert_dir / 'ca.crt')!r}); "
            f"urllib.request.urlopen({url!r}, timeout=2, context=ctx)"
        )
        self.node.network.exec(sys.executable, "-c", probe, timeout=10)
        return True

    def _register_apiservice(self) -> None:
        existing = self.node.kubectl("get", "apiservice", APISERVICE, "-o", "json", check=False)
        if existing.returncode == 0:
            found = json.loads(existing.stdout)
            if found["spec"].get("service", {}).get("namespace") != KEDA_NAMESPACE:
                meta = found["metadata"]
                self._displaced_apiservice = {
                    "apiVersion": found["apiVersion"],
                    "kind": found["kind"],
                    "metadata": {k: meta[k] for k in ("name", "labels", "annotations") if k in meta},
                    "spec": found["spec"],
                }
                self.node.kubectl("delete", "apiservice", APISERVICE, "--wait=true")
        port = {"name": "https", "port": 443, "targetPort": ADAPTER_SECURE_PORT, "protocol": "TCP"}
        objects = [
            {
                # Selector-less: the adapter is no pod, its one endpoint is named below.
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": ADAPTER_SERVICE, "namespace": KEDA_NAMESPACE},
                "spec": {"ports": [port]},
            },
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": ADAPTER_SERVICE,
                    "namespace": KEDA_NAMESPACE,
                    "labels": {"kubernetes.io/service-name": ADAPTER_SERVICE},
                },
                "addressType": "IPv4",
                "endpoints": [{"addresses": [self.node.node_ip], "conditions": {"ready": True}}],
                "ports": [{"name": "https", "port": ADAPTER_SECURE_PORT, "protocol": "TCP"}],
            },
            {
                "apiVersion": "apiregistration.k8s.io/v1",
                "kind": "APIService",
                "metadata": {"name": APISERVICE, "labels": {"app.kubernetes.io/part-of": "keda-operator"}},
                "spec": {
                    "service": {"name": ADAPTER_SERVICE, "namespace": KEDA_NAMESPACE, "port": 443},
                    "group": "external.metrics.k8s.io",
                    "version": "v1beta1",
                    "caBundle": base64.b64encode(self.ca_bundle).decode(),
                    "groupPriorityMinimum": 100,
                    "versionPriority": 100,
                },
            },
        ]
        self.node.kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
        )
        out = self.node.kubectl(
            "wait",
            "--for=condition=Available",
            f"apiservice/{APISERVICE}",
            f"--timeout={int(START_TIMEOUT_S)}s",
            check=False,
            timeout=START_TIMEOUT_S + 30,
        )
        if out.returncode != 0:
            status = self.node.kubectl(
                "get", "apiservice", APISERVICE, "-o", "jsonpath={.status}", check=False
            )
            raise ServiceUnavailable(
                f"APIService {APISERVICE} not Available: {out.stderr}{status.stdout}\n{self.log_tail('keda-adapter')}"
            )
