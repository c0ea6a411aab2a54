"""A loopback Kubernetes control plane for tests, run the way controller-runtime's envtest runs one.

etcd, kube-apiserver, kube-controller-manager and kubectl are built from their Go modules (no
container engine, no release downloads), cached under ``cache_dir("bin", "<name>-<version>")``
and started on free loopback ports with certificates and tokens generated per run.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from testenv._common import (
    ServiceUnavailable,
    cache_dir,
    file_lock,
    free_port,
    go_env,
    log_tail,
    progress,
    run_logged,
    stop_process,
    wait_until,
)
from testenv.pki import CertificateAuthority, signing_key_pair

KUBERNETES_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.3"
KUBE_BINARIES = ("kube-apiserver", "kube-controller-manager", "kubectl")
NODE_BINARIES = ("kubelet", "kube-scheduler", "kube-proxy")
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"

# A cold build of the Kubernetes binaries takes tens of minutes on two cores; a warm one seconds.
BUILD_TIMEOUT_S = 3600.0
APISERVER_READY_TIMEOUT_S = 180.0
ETCD_READY_TIMEOUT_S = 60.0
CONTROLLER_MANAGER_READY_TIMEOUT_S = 120.0
KUBECTL_TIMEOUT_S = 60.0

ADMIN_USER = "agent-dispatch-admin"
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"


# --------------------------------------------------------------------------------------------------
# Building Go programs from their modules
# --------------------------------------------------------------------------------------------------


def bin_path(name: str, version: str) -> Path:
    """Where the cached binary ``name`` at ``version`` lives (the directory is keyed by version)."""
    return cache_dir("bin", f"{name}-{version}") / name


def _download_module(module: str, version: str, *, env: Mapping[str, str], log: Path) -> dict[str, Any]:
    """Fetch one module through the module proxy; returns ``go mod download -json`` (GoMod, Info...).

    It runs outside any module (the cache's build root has no go.mod), so it never touches a go.mod
    that a concurrent build is using.
    """
    if shutil.which("go", path=env.get("PATH")) is None:
        raise ServiceUnavailable(f"no Go toolchain on PATH: cannot build from {module}")
    cmd = ["go", "mod", "download", "-json", f"{module}@{version}"]
    try:
        proc = subprocess.run(
            cmd,
            cwd=cache_dir("build"),
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ServiceUnavailable(f"go mod download {module}@{version} timed out") from exc
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        raise ServiceUnavailable(f"go mod download {module}@{version} failed\n{log_tail(log)}")
    info: dict[str, Any] = json.loads(proc.stdout)
    if info.get("Error"):
        raise ServiceUnavailable(f"go mod download {module}@{version}: {info['Error']}")
    return info


def _go_directive(go_mod_text: str) -> str:
    match = re.search(r"^go\s+(\S+)\s*$", go_mod_text, re.MULTILINE)
    return match.group(1) if match else "1.22"


def build_go_programs(
    *,
    key: str,
    module: str,
    version: str,
    programs: Mapping[str, str],
    ldflags: Sequence[str],
    outputs: Mapping[str, Path],
    extra_go_mod: str = "",
) -> None:
    """Build ``programs`` (binary name -> package) from a throwaway module requiring ``module@version``.

    The module directory lives in the cache so go.sum persists; binaries are built into a scratch
    directory and renamed into place, so a half-written binary is never taken for a cached one.
    """
    build_root = cache_dir("build")
    with file_lock(build_root / f"{key}.lock", BUILD_TIMEOUT_S + 600):
        if all(path.is_file() for path in outputs.values()):
            return
        module_dir = cache_dir("build", key)
        log = module_dir / "build.log"
        env = go_env()
        info = _download_module(module, version, env=env, log=log)
        go_version = _go_directive(Path(info["GoMod"]).read_text())
        (module_dir / "go.mod").write_text(
            f"module agentdispatch.local/{key}\n\ngo {go_version}\n\nrequire {module} {version}\n"
            f"{extra_go_mod}"
        )
        scratch = Path(tempfile.mkdtemp(prefix="out-", dir=module_dir))
        try:
            for name, package in programs.items():
                _build_one(
                    name, package, module_dir=module_dir, scratch=scratch, env=env, ldflags=ldflags, log=log
                )
                outputs[name].parent.mkdir(parents=True, exist_ok=True)
                os.replace(scratch / name, outputs[name])
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _build_one(
    name: str,
    package: str,
    *,
    module_dir: Path,
    scratch: Path,
    env: Mapping[str, str],
    ldflags: Sequence[str],
    log: Path,
) -> None:
    progress(f"building {name} from {package} (a cold build takes minutes; cached afterwards)")
    started = time.monotonic()
    run_logged(
        [
            "go",
            "build",
            "-mod=mod",
            "-trimpath",
            "-ldflags",
            " ".join(ldflags),
            "-o",
            scratch / name,
            package,
        ],
        log,
        cwd=module_dir,
        env=dict(env),
        timeout=BUILD_TIMEOUT_S,
    )
    progress(f"built {name} in {time.monotonic() - started:.0f}s")


def _staging_version(kubernetes_version: str) -> str:
    """k8s.io/kubernetes v1.N.P publishes its staging modules (k8s.io/api, ...) as v0.N.P."""
    return "v0." + kubernetes_version.removeprefix("v").split(".", 1)[1]


def _staging_replaces(kubernetes_go_mod: str, staging_version: str) -> str:
    """k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with ./staging paths,
    which a dependent module cannot see: point each at its published release instead."""
    names = sorted(
        set(
            re.findall(
                r"^\s*(?:require\s+)?(k8s\.io/[\w.\-/]+)\s+v0\.0\.0\s*$", kubernetes_go_mod, re.MULTILINE
            )
        )
    )
    return "".join(f"replace {name} => {name} {staging_version}\n" for name in names)


def _kubernetes_ldflags(version: str, info_file: Path) -> list[str]:
    """Stamp what ``hack/lib/version.sh`` stamps, so ``--version`` and /version report the release."""
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    commit = str(info.get("Origin", {}).get("Hash", ""))
    build_date = str(info.get("Time", "1970-01-01T00:00:00Z")).replace("+00:00", "Z")
    major, minor = version.removeprefix("v").split(".")[:2]
    values = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitCommit": commit,
        "gitTreeState": "clean",
        "buildDate": build_date,
    }
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {package}.{key}={value}" for key, value in values.items() if value]
    return flags


def _ensure_etcd() -> Path:
    out = bin_path("etcd", ETCD_VERSION)
    if not out.is_file():
        build_go_programs(
            key=f"etcd-{ETCD_VERSION}",
            module="go.etcd.io/etcd/server/v3",
            version=ETCD_VERSION,
            programs={"etcd": "go.etcd.io/etcd/server/v3"},
            ldflags=["-s", "-w"],
            outputs={"etcd": out},
        )
    return out


def ensure_kubernetes(names: Sequence[str] = KUBE_BINARIES) -> dict[str, Path]:
    """Build (once) the named programs of k8s.io/kubernetes; only the missing ones are built."""
    outputs = {name: bin_path(name, KUBERNETES_VERSION) for name in names}
    missing = {name: path for name, path in outputs.items() if not path.is_file()}
    if not missing:
        return outputs
    key = f"kubernetes-{KUBERNETES_VERSION}"
    # The replace lines depend on k8s.io/kubernetes' own go.mod, so fetch that first.
    info = _download_module(
        "k8s.io/kubernetes", KUBERNETES_VERSION, env=go_env(), log=cache_dir("build", key) / "build.log"
    )
    replaces = _staging_replaces(Path(info["GoMod"]).read_text(), _staging_version(KUBERNETES_VERSION))
    if not replaces:
        raise ServiceUnavailable(f"no staging modules found in k8s.io/kubernetes {KUBERNETES_VERSION}")
    build_go_programs(
        key=key,
        module="k8s.io/kubernetes",
        version=KUBERNETES_VERSION,
        programs={name: f"k8s.io/kubernetes/cmd/{name}" for name in missing},
        ldflags=_kubernetes_ldflags(KUBERNETES_VERSION, Path(info["Info"])),
        outputs=missing,
        extra_go_mod="\n" + replaces,
    )
    return outputs


def ensure_built() -> dict[str, Path]:
    """Build (once) and return etcd, kube-apiserver, kube-controller-manager and kubectl."""
    binaries = {"etcd": _ensure_etcd()}
    binaries.update(ensure_kubernetes())
    return binaries


# --------------------------------------------------------------------------------------------------
# Certificates, tokens and kubeconfigs
# --------------------------------------------------------------------------------------------------


def _generate_pki(pki: Path, *, addresses: Sequence[str] = ("127.0.0.1",)) -> CertificateAuthority:
    """A throwaway CA, the apiserver's serving certificate and the service-account signing key."""
    pki.mkdir(parents=True, exist_ok=True)
    ca = CertificateAuthority(pki, "ca")
    service_ip = str(next(ipaddress.IPv4Network(SERVICE_CLUSTER_IP_RANGE).hosts()))
    sans = [
        *addresses,
        service_ip,
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    ca.issue("apiserver", "kube-apiserver", sans=sans, server=True)
    signing_key_pair(pki, "sa")
    return ca


def write_kubeconfig(path: Path, *, server: str, ca_file: Path, user: str, token: str) -> Path:
    """A kubeconfig that authenticates with a bearer token (admin, controller-manager, or a test's SA)."""
    import base64

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "agent-dispatch-test",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_file.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "agent-dispatch-test", "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


# --------------------------------------------------------------------------------------------------
# The control plane
# --------------------------------------------------------------------------------------------------


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl call whose message carries kubectl's own error output."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr}"


def _spawn(cmd: Sequence[str | os.PathLike[str]], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
        out.flush()
        return subprocess.Popen(
            list(map(str, cmd)), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


class ControlPlane:
    """etcd + kube-apiserver on loopback (and kube-controller-manager on demand).

    Authentication is a static token file: the admin user is in ``system:masters``; authorization is
    RBAC, so tokens of ServiceAccounts (TokenRequest) get exactly what their Roles grant.
    """

    def __init__(self, binaries: Mapping[str, Path] | None = None) -> None:
        self._binaries = dict(binaries) if binaries is not None else None
        self.workdir = Path(tempfile.mkdtemp(prefix="agent-dispatch-kube-"))
        self.log_dir = self.workdir / "logs"
        self.pki_dir = self.workdir / "pki"
        self.ca_file = self.pki_dir / "ca.crt"
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.token = secrets.token_urlsafe(32)
        self._controller_manager_token = secrets.token_urlsafe(32)
        self.ca: CertificateAuthority | None = None
        #: Further component users (user name -> bearer token and groups) for the static token file.
        self.component_tokens: dict[str, tuple[str, tuple[str, ...]]] = {}
        self.port = 0
        self.server = ""
        self.version = ""
        self.etcd_url = ""
        self._etcd_peer_port = 0
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None
        self._controller_manager: subprocess.Popen[bytes] | None = None
        self._stopped = False

    #: The address kube-apiserver serves on (a subclass on a node serves on the node's address).
    address = "127.0.0.1"

    def _choose_port(self) -> int:
        return free_port()

    def _spawn(self, cmd: Sequence[str | os.PathLike[str]], log: Path) -> subprocess.Popen[bytes]:
        """Start one control-plane process (a subclass may wrap it, e.g. into a network namespace)."""
        return _spawn(cmd, log)

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        """Build if needed, start etcd and kube-apiserver, wait for /readyz, write the kubeconfig."""
        started = time.monotonic()
        atexit.register(self.stop)
        try:
            if self._binaries is None:
                self._binaries = ensure_built()
            self._prepare_credentials()
            self._start_etcd()
            self._start_apiserver()
            self.version = str(self._get_json("/version")["gitVersion"])
        except BaseException:
            self.stop()
            raise
        progress(
            f"kube-apiserver {self.version} ready at {self.server} "
            f"in {time.monotonic() - started:.1f}s (logs: {self.log_dir})"
        )
        return self

    def _prepare_credentials(self) -> None:
        self.ca = _generate_pki(self.pki_dir, addresses=sorted({self.address, "127.0.0.1"}))
        (self.workdir / "tokens.csv").write_text(
            f'{self.token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
            f"{self._controller_manager_token},{CONTROLLER_MANAGER_USER},{CONTROLLER_MANAGER_USER}\n"
            + "".join(
                f'{token},{user},{user},"{",".join(groups)}"\n'
                for user, (token, groups) in self.component_tokens.items()
            )
        )
        self.port = self._choose_port()
        self.server = f"https://{self.address}:{self.port}"
        write_kubeconfig(
            self.kubeconfig, server=self.server, ca_file=self.ca_file, user=ADMIN_USER, token=self.token
        )

    def stop(self) -> None:
        """Stop every process (controller-manager, apiserver, etcd) and remove the scratch directory."""
        if self._stopped:
            return
        self._stopped = True
        for proc in (self._controller_manager, self._apiserver, self._etcd):
            stop_process(proc, timeout=15)
        if not os.environ.get("AGENT_DISPATCH_KEEP_KUBE"):
            shutil.rmtree(self.workdir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def _processes(self) -> list[subprocess.Popen[bytes]]:
        """The control plane's live processes (their pids go into a node run's state file)."""
        procs = (self._etcd, self._apiserver, self._controller_manager)
        return [proc for proc in procs if proc is not None and proc.poll() is None]

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again on the same port against the same etcd (chaos)."""
        stop_process(self._apiserver, timeout=30)
        self._start_apiserver()

    def stop_apiserver(self) -> None:
        """Take the API server down (chaos tests); ``start_apiserver`` brings it back on the same port."""
        stop_process(self._apiserver, timeout=30)

    def start_apiserver(self) -> None:
        if self._apiserver is not None and self._apiserver.poll() is None:
            return
        self._start_apiserver()

    # -- etcd --------------------------------------------------------------------------------------

    def _start_etcd(self) -> None:
        client_port, self._etcd_peer_port = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{self._etcd_peer_port}"
        log = self.log_dir / "etcd.log"
        self._etcd = self._spawn(
            [
                self._bin("etcd"),
                "--name=agent-dispatch-test",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=agent-dispatch-test={peer_url}",
                # As envtest: a throwaway store does not need fsync, and fsync dominates on slow disks.
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
            log,
        )
        wait_until(self._etcd_healthy, timeout=ETCD_READY_TIMEOUT_S, what="etcd", log=log, proc=self._etcd)

    def _etcd_healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as response:
            return bool(json.load(response).get("health") == "true")

    # -- kube-apiserver ----------------------------------------------------------------------------

    def _apiserver_args(self) -> list[str]:
        pki = self.pki_dir
        return [
            str(self._bin("kube-apiserver")),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # The endpoint reconciler refuses a loopback address; no Pod needs the "kubernetes"
            # Service's endpoints here.
            "--endpoint-reconciler-type=none",
            f"--secure-port={self.port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={self.server}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--allow-privileged=true",
            # As envtest: there is no kubelet, and without the controller-manager's ServiceAccount
            # controller no namespace has a "default" ServiceAccount, so this plugin would block Pods.
            "--disable-admission-plugins=ServiceAccount",
            "--profiling=false",
            "--v=1",
        ]

    def _start_apiserver(self) -> None:
        log = self.log_dir / "kube-apiserver.log"
        self._apiserver = self._spawn(self._apiserver_args(), log)
        wait_until(
            self._apiserver_ready,
            timeout=APISERVER_READY_TIMEOUT_S,
            what="kube-apiserver",
            log=log,
            proc=self._apiserver,
            interval=0.5,
        )

    def _ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def _get(self, path: str, timeout: float = 5) -> tuple[int, bytes]:
        request = urllib.request.Request(
            f"{self.server}{path}", headers={"Authorization": f"Bearer {self.token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self._ssl_context()) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()

    def _get_json(self, path: str) -> dict[str, Any]:
        status, body = self._get(path)
        if status != 200:
            raise ServiceUnavailable(
                f"GET {path} answered {status}: {body[:300]!r}\n"
                f"{log_tail(self.log_dir / 'kube-apiserver.log')}"
            )
        result: dict[str, Any] = json.loads(body)
        return result

    def _apiserver_ready(self) -> bool:
        return self._get("/readyz", timeout=3)[0] == 200

    def is_ready(self) -> bool:
        """True when kube-apiserver answers /readyz (False while it is down, e.g. in a chaos test)."""
        try:
            return self._apiserver_ready()
        except OSError:
            return False

    # -- kube-controller-manager -------------------------------------------------------------------

    def start_controller_manager(self, extra_args: Sequence[str] = ()) -> None:
        """Start kube-controller-manager (idempotent), so Deployments get ReplicaSets and Pods,
        namespaces get their "default" ServiceAccount and kube-root-ca.crt, and deleted namespaces
        are emptied and removed."""
        if self._controller_manager is not None and self._controller_manager.poll() is None:
            return
        kubeconfig = write_kubeconfig(
            self.workdir / "controller-manager.kubeconfig",
            server=self.server,
            ca_file=self.ca_file,
            user=CONTROLLER_MANAGER_USER,
            token=self._controller_manager_token,
        )
        pki = self.pki_dir
        port = free_port()
        log = self.log_dir / "kube-controller-manager.log"
        self._controller_manager = self._spawn(
            [
                self._bin("kube-controller-manager"),
                f"--kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'controller-manager-certs'}",
                "--leader-elect=false",
                # Each controller runs as its own ServiceAccount under the bootstrap RBAC roles, as in a
                # real cluster; the manager's own user only has system:kube-controller-manager.
                "--use-service-account-credentials=true",
                # Enables the ServiceAccount token controller (legacy token Secrets) and root CA publisher.
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--profiling=false",
                "--v=1",
                *extra_args,
            ],
            log,
        )
        # Ready means its controllers act: the ServiceAccount controller fills the default namespace.
        wait_until(
            self._default_service_account_exists,
            timeout=CONTROLLER_MANAGER_READY_TIMEOUT_S,
            what="kube-controller-manager",
            log=log,
            proc=self._controller_manager,
            interval=0.5,
        )

    def _default_service_account_exists(self) -> bool:
        return self._get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200

    # -- helpers for tests -------------------------------------------------------------------------

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        timeout: float = KUBECTL_TIMEOUT_S,
        check: bool = True,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this control plane (admin unless ``kubeconfig`` is given)."""
        cmd = [
            str(self._bin("kubectl")),
            f"--kubeconfig={kubeconfig or self.kubeconfig}",
            # A per-run discovery cache: ports are reused across runs with different CRDs.
            f"--cache-dir={self.workdir / 'kubectl-cache'}",
            *args,
        ]
        try:
            proc = subprocess.run(
                cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise ServiceUnavailable(f"kubectl {' '.join(args)} timed out after {timeout}s") from exc
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def kubeconfig_for_token(self, token: str, name: str) -> Path:
        """A kubeconfig for another identity, e.g. a ServiceAccount token from the TokenRequest API."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        return write_kubeconfig(
            self.workdir / f"{safe}.kubeconfig",
            server=self.server,
            ca_file=self.ca_file,
            user=name,
            token=token,
        )

    @property
    def env(self) -> dict[str, str]:
        """Environment entries that point clients (kopf, kubectl, helm) at this control plane."""
        return {"KUBECONFIG": str(self.kubeconfig)}

    def _bin(self, name: str) -> Path:
        assert self._binaries is not None, "start() resolves the binaries"
        return self._binaries[name]
