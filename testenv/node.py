"""A real single-node Kubernetes cluster for tests: pods of the project's image actually run.

Inside a network namespace of the test's own (testenv/netns.py): etcd, kube-apiserver (Node+RBAC
authorization, the ServiceAccount and NodeRestriction admission plugins, front-proxy flags for
aggregated APIs), kube-controller-manager (fast HPA sync), kube-scheduler, containerd with runc and
the CNI bridge plugin, kubelet and kube-proxy (iptables). The Kubernetes programs are built from
the same Go module as the apiserver; containerd, runc and the CNI plugins come from Debian.

What this sandbox needs, learned by running it (each is a comment where it is configured):
containerd must not raise oom_score_adj, kubelet must accept cgroup v1 and the cgroupfs driver,
and the pause image is built locally because no registry is reachable.

One node per machine at a time (kubelet's cgroups are machine-wide): a file lock guards it, and a
run that died without tearing down is cleaned up by the next one from the state file it left.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
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
    apt_install,
    cache_dir,
    file_lock,
    log_tail,
    progress,
    stop_process,
    unmount_under,
    wait_until,
)
from testenv.image import BuiltImages, build_images
from testenv.kube import (
    KUBE_BINARIES,
    NODE_BINARIES,
    ControlPlane,
    _spawn,
    ensure_built,
    ensure_kubernetes,
    write_kubeconfig,
)
from testenv.netns import NETNS_DIR, NetworkNamespace

NODE_NAME = "adx-node"
POD_CIDR = "10.244.0.0/24"
APISERVER_PORT = 6443
KUBELET_PORT = 10250
NODE_READY_TIMEOUT_S = 180.0
CONTAINERD_READY_TIMEOUT_S = 60.0
HOST_PACKAGES = {
    "containerd": "containerd",
    "runc": "runc",
    "/usr/lib/cni/bridge": "containernetworking-plugins",
    "iptables": "iptables",
    "conntrack": "conntrack",
    "nsenter": "util-linux",
}
FRONT_PROXY_USER = "front-proxy-client"
KUBELET_USER = f"system:node:{NODE_NAME}"
#: Fast autoscaling in tests: the HPA controller acts every 2 s and scales down without waiting
#: (each sync is a few list calls for the handful of HPAs a test has: nothing on this machine).
HPA_FLAGS = (
    "--horizontal-pod-autoscaler-sync-period=2s",
    "--horizontal-pod-autoscaler-downscale-stabilization=0s",
)
STATE_DIR_NAME = "node-runs"


def _ensure_host_packages() -> None:
    missing = sorted(
        {
            package
            for tool, package in HOST_PACKAGES.items()
            if not (Path(tool).exists() if tool.startswith("/") else shutil.which(tool))
        }
    )
    if missing:
        apt_install(missing, cache_dir("logs") / "apt-node.log")


def ensure_node_built() -> dict[str, Path]:
    """Build (once) every program the node runs; install the Debian packages it needs."""
    _ensure_host_packages()
    binaries = ensure_built()
    binaries.update(ensure_kubernetes((*KUBE_BINARIES, *NODE_BINARIES)))
    return binaries


class NodeControlPlane(ControlPlane):
    """The control plane of a cluster with a node: served on the node's address inside the namespace."""

    def __init__(self, binaries: dict[str, Path], network: NetworkNamespace, workdir: Path) -> None:
        super().__init__(binaries)
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = workdir
        self.log_dir = workdir / "logs"
        self.pki_dir = workdir / "pki"
        self.ca_file = self.pki_dir / "ca.crt"
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.network = network
        self.address = network.node_ip
        for user, groups in (
            (KUBELET_USER, ("system:nodes",)),
            ("system:kube-scheduler", ()),
            ("system:kube-proxy", ()),
        ):
            self.component_tokens[user] = (secrets.token_urlsafe(32), groups)

    def _choose_port(self) -> int:
        return APISERVER_PORT

    def _etcd_healthy(self) -> bool:
        # etcd listens on the namespace's loopback only (pods must not reach it): ask from inside.
        probe = f"import urllib.request; urllib.request.urlopen('{self.etcd_url}/health', timeout=2)"
        self.network.exec(sys.executable, "-c", probe, timeout=10)
        return True

    def _spawn(self, cmd: Sequence[str | os.PathLike[str]], log: Path) -> subprocess.Popen[bytes]:
        return _spawn(self.network.wrap(cmd), log)

    def _prepare_credentials(self) -> None:
        super()._prepare_credentials()
        assert self.ca is not None
        self.ca.issue(
            "apiserver-kubelet-client",
            "kube-apiserver-kubelet-client",
            organizations=("system:masters",),
            client=True,
        )
        self.ca.issue("kubelet", NODE_NAME, sans=(self.address, NODE_NAME), server=True)
        # The front proxy has a CA of its own, as kubeadm sets it up: the aggregated API servers
        # trust exactly the client certificate the apiserver presents when it proxies to them.
        from testenv.pki import CertificateAuthority

        front = CertificateAuthority(self.pki_dir, "front-proxy-ca")
        front.issue("front-proxy-client", FRONT_PROXY_USER, client=True)

    def _apiserver_args(self) -> list[str]:
        dropped = (
            "--bind-address=",
            "--advertise-address=",
            "--endpoint-reconciler-type=",
            "--authorization-mode=",
            "--disable-admission-plugins=",
        )
        args = [arg for arg in super()._apiserver_args() if not arg.startswith(dropped)]
        pki = self.pki_dir
        return [
            *args,
            # Inside the namespace "all addresses" are its loopback, the veth end and the pods' bridge.
            "--bind-address=0.0.0.0",
            f"--advertise-address={self.address}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            f"--requestheader-allowed-names={FRONT_PROXY_USER}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            # The apiserver dials an aggregated API's endpoint (a pod address) directly.
            "--enable-aggregator-routing=true",
        ]

    def component_kubeconfig(self, user: str) -> Path:
        token, _groups = self.component_tokens[user]
        safe = user.replace(":", "-")
        return write_kubeconfig(
            self.workdir / f"{safe}.kubeconfig",
            server=self.server,
            ca_file=self.ca_file,
            user=user,
            token=token,
        )


class NodeCluster:
    """Control plane + node in a namespace; ``start()``, load images, run pods, ``stop()``."""

    def __init__(self) -> None:
        # Made once the node lock is held (start()): a process killed while it waits for the lock
        # leaves no directory behind.
        self.workdir = (
            Path(tempfile.gettempdir()) / f"agent-dispatch-node-{os.getpid()}-{secrets.token_hex(4)}"
        )
        self.log_dir = self.workdir / "logs"
        self.network = NetworkNamespace()
        self.plane: NodeControlPlane | None = None
        self.images: BuiltImages | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lock_cm: contextlib.AbstractContextManager[None] | None = None
        self._netns_before: set[str] = set()
        self._stopped = False
        self.timings: dict[str, float] = {}

    # -- paths -------------------------------------------------------------------------------------

    @property
    def containerd_socket(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"

    @property
    def state_file(self) -> Path:
        return cache_dir(STATE_DIR_NAME) / f"{self.network.name}.json"

    @property
    def kubeconfig(self) -> Path:
        assert self.plane is not None
        return self.plane.kubeconfig

    @property
    def host_ip(self) -> str:
        """The host end of the veth: servers that pods must reach listen here."""
        return self.network.host_ip

    @property
    def node_ip(self) -> str:
        return self.network.node_ip

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> NodeCluster:
        started = time.monotonic()
        atexit.register(self.stop)
        try:
            binaries = ensure_node_built()
            self.timings["build_s"] = time.monotonic() - started
            mark = time.monotonic()
            self.images = build_images()
            self.timings["image_s"] = time.monotonic() - mark
            self._lock_cm = file_lock(cache_dir("locks") / "node.lock", timeout=1800)
            self._lock_cm.__enter__()
            self.workdir.mkdir(mode=0o700)
            reap_stale_runs()
            self._netns_before = set(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else set()
            mark = time.monotonic()
            self.network.create()
            self._write_state()
            self.plane = NodeControlPlane(binaries, self.network, self.workdir)
            self.plane.start()
            self.plane.start_controller_manager(extra_args=HPA_FLAGS)
            self._start_scheduler(binaries)
            self._start_containerd()
            self.load_image(self.images.pause)
            self.load_image(self.images.app)
            self._start_kubelet(binaries)
            self._start_kube_proxy(binaries)
            self._wait_node_ready()
            self.timings["start_s"] = time.monotonic() - mark
        except BaseException:
            self.stop()
            raise
        progress(
            f"node {NODE_NAME} Ready at {self.node_ip} in {time.monotonic() - started:.0f}s "
            f"(apiserver {self.plane.server}, logs {self.log_dir})"
        )
        return self

    def _spawn(self, name: str, cmd: Sequence[str | os.PathLike[str]]) -> subprocess.Popen[bytes]:
        proc = _spawn(self.network.wrap(cmd), self.log_dir / f"{name}.log")
        self._procs[name] = proc
        self._write_state()
        return proc

    def _write_state(self) -> None:
        """What a later run needs to clean up after this one if it dies without stopping."""
        state = {
            "owner_pid": os.getpid(),
            "netns": self.network.name,
            "host_link": self.network.host_link,
            "workdir": str(self.workdir),
            "pids": [proc.pid for proc in self._procs.values()]
            + ([p.pid for p in self.plane._processes()] if self.plane is not None else []),
            "netns_before": sorted(self._netns_before),
        }
        self.state_file.write_text(json.dumps(state))

    # -- containerd ----------------------------------------------------------------------------------

    def _start_containerd(self) -> None:
        root = self.workdir / "containerd"
        cni_conf = self.workdir / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-adx.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": "adx-pods",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": "cni0",
                            "isGateway": True,
                            "ipMasq": True,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_CIDR}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(self.workdir / "cni" / "ipam"),
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                    ],
                },
                indent=2,
            )
        )
        assert self.images is not None
        config = root / "config.toml"
        root.mkdir(parents=True, exist_ok=True)
        config.write_text(
            f"""version = 2
root = "{root / "root"}"
state = "{root / "state"}"

[grpc]
  address = "{self.containerd_socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root / "opt"}"

[plugins."io.containerd.grpc.v1.cri"]
  # No registry is reachable: the sandbox image is built locally and imported before any pod.
  sandbox_image = "{self.images.pause_ref}"
  # This sandbox lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj below its own.
  restrict_oom_score_adj = true
  enable_unprivileged_ports = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # cgroup v1 with the cgroupfs driver, as the kubelet is configured.
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni_conf}"
"""
        )
        proc = self._spawn("containerd", ["containerd", f"--config={config}"])
        wait_until(
            lambda: self.ctr("version", check=False).returncode == 0,
            timeout=CONTAINERD_READY_TIMEOUT_S,
            what="containerd",
            log=self.log_dir / "containerd.log",
            proc=proc,
            interval=0.3,
        )

    def ctr(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        cmd = ["ctr", f"--address={self.containerd_socket}", "--namespace=k8s.io", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise ServiceUnavailable(f"ctr {' '.join(args[:3])} failed: {proc.stderr.strip()}")
        return proc

    def load_image(self, tarball: Path) -> None:
        """Import an image tarball (docker save format) into the node's containerd."""
        self.ctr("images", "import", "--no-unpack", str(tarball))

    # -- kubelet, scheduler, kube-proxy ----------------------------------------------------------------

    def _start_kubelet(self, binaries: dict[str, Path]) -> None:
        assert self.plane is not None
        pki = self.plane.pki_dir
        resolv = self.workdir / "resolv.conf"
        # Pods get no name server: the test cluster has no DNS and pods must reach nothing outside.
        resolv.write_text("")
        config = self.workdir / "kubelet-config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    # The sandbox runs cgroup v1, which kubelet 1.35+ refuses unless told otherwise.
                    "failCgroupV1": False,
                    "cgroupDriver": "cgroupfs",
                    "failSwapOn": False,
                    "address": self.node_ip,
                    "port": KUBELET_PORT,
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": 10248,
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": True},
                        "x509": {"clientCAFile": str(pki / "ca.crt")},
                    },
                    "authorization": {"mode": "Webhook"},
                    "tlsCertFile": str(pki / "kubelet.crt"),
                    "tlsPrivateKeyFile": str(pki / "kubelet.key"),
                    "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
                    "resolvConf": str(resolv),
                    "clusterDomain": "cluster.local",
                    # The test disk is shared with builds and caches: never evict for disk pressure.
                    "evictionHard": {
                        "memory.available": "100Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                        "nodefs.inodesFree": "1%",
                    },
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "serializeImagePulls": False,
                    "maxPods": 60,
                    "syncFrequency": "10s",
                    "fileCheckFrequency": "10s",
                    "nodeStatusUpdateFrequency": "5s",
                    "shutdownGracePeriod": "0s",
                }
            )
        )
        self._spawn(
            "kubelet",
            [
                binaries["kubelet"],
                f"--config={config}",
                f"--kubeconfig={self.plane.component_kubeconfig(KUBELET_USER)}",
                f"--root-dir={self.workdir / 'kubelet'}",
                f"--cert-dir={self.workdir / 'kubelet-pki'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={self.node_ip}",
                "--v=1",
            ],
        )

    def _start_scheduler(self, binaries: dict[str, Path]) -> None:
        assert self.plane is not None
        kubeconfig = self.plane.component_kubeconfig("system:kube-scheduler")
        self._spawn(
            "kube-scheduler",
            [
                binaries["kube-scheduler"],
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                "--secure-port=10259",
                "--leader-elect=false",
                "--v=1",
            ],
        )

    def _start_kube_proxy(self, binaries: dict[str, Path]) -> None:
        assert self.plane is not None
        config = self.workdir / "kube-proxy-config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "clientConnection": {
                        "kubeconfig": str(self.plane.component_kubeconfig("system:kube-proxy"))
                    },
                    "mode": "iptables",
                    "clusterCIDR": POD_CIDR,
                    "hostnameOverride": NODE_NAME,
                    "bindAddress": self.node_ip,
                    "healthzBindAddress": "127.0.0.1:10256",
                    "metricsBindAddress": "127.0.0.1:10249",
                    # conntrack limits are machine-wide sysctls: leave the host's alone.
                    "conntrack": {"maxPerCore": 0, "min": 0},
                }
            )
        )
        self._spawn("kube-proxy", [binaries["kube-proxy"], f"--config={config}", "--v=1"])

    def _wait_node_ready(self) -> None:
        assert self.plane is not None

        def ready() -> bool:
            out = self.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
            if out.returncode != 0:
                return False
            conditions = json.loads(out.stdout)["status"].get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        wait_until(
            ready,
            timeout=NODE_READY_TIMEOUT_S,
            what=f"node {NODE_NAME} Ready",
            log=self.log_dir / "kubelet.log",
            proc=self._procs["kubelet"],
            interval=1.0,
        )

    # -- helpers -------------------------------------------------------------------------------------

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert self.plane is not None
        return self.plane.kubectl(*args, **kwargs)

    @property
    def env(self) -> dict[str, str]:
        return {"KUBECONFIG": str(self.kubeconfig)}

    def log_tail(self, name: str, lines: int = 40) -> str:
        return log_tail(self.log_dir / f"{name}.log", lines)

    # -- teardown ------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop everything (containers, node, control plane), then remove mounts, netns and files."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        for name in ("kube-proxy", "kubelet"):
            stop_process(self._procs.get(name), timeout=20)
        if self._procs.get("containerd") is not None:
            _kill_containers(self)
        for name in ("containerd", "kube-scheduler"):
            stop_process(self._procs.get(name), timeout=20)
        if self.plane is not None:
            self.plane.stop()
        _teardown(
            netns=self.network,
            workdir=self.workdir,
            netns_before=self._netns_before,
            keep=bool(os.environ.get("AGENT_DISPATCH_KEEP_KUBE")),
        )
        with contextlib.suppress(OSError):
            self.state_file.unlink()
        if self._lock_cm is not None:
            self._lock_cm.__exit__(None, None, None)
            self._lock_cm = None


def _kill_containers(cluster: NodeCluster) -> None:
    """Kill and delete every task containerd runs for the node, so shims and mounts go away.

    One ``ctr tasks delete --force`` for all of them (it kills each task's process and waits for
    it): a kill and then a delete per task, each its own ``ctr`` process, took about 30 s.
    """

    def listed() -> list[str]:
        return cluster.ctr("tasks", "list", "--quiet", check=False).stdout.split()

    deadline, listing = time.monotonic() + 30, listed()
    while listing and time.monotonic() < deadline:
        cluster.ctr("tasks", "delete", "--force", *listing, check=False, timeout=30)
        listing = listed()
        if listing:
            time.sleep(0.5)  # a task that outlived the delete gets a moment, not a ctr call per instant
    if not listing:
        return
    progress(f"node: tasks still listed after 30 s: {' '.join(listing)}")


def _remove_pod_netns(before: set[str]) -> None:
    """The pods' network namespaces this run's containerd made (cni-*), unmounted and removed."""
    if not NETNS_DIR.is_dir():
        return
    for name in set(os.listdir(NETNS_DIR)) - before:
        if name.startswith("cni-"):
            path = NETNS_DIR / name
            pids = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True, check=False, timeout=30
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False, timeout=30)
            with contextlib.suppress(OSError):
                path.unlink()


def _remove_kubepods_cgroups() -> None:
    """kubelet's pod cgroups (cgroup v1, cgroupfs driver), deepest first, once they hold no task."""
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / "kubepods"
        if not top.is_dir():
            continue
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _teardown(*, netns: NetworkNamespace, workdir: Path, netns_before: set[str], keep: bool) -> None:
    netns.destroy()
    _remove_pod_netns(netns_before)
    unmount_under(workdir)
    _remove_kubepods_cgroups()
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)


def reap_stale_runs() -> None:
    """Clean up after node runs whose owner died without stopping them (processes by pid first)."""
    for state_file in cache_dir(STATE_DIR_NAME).glob("*.json"):
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            state_file.unlink(missing_ok=True)
            continue
        owner = int(state.get("owner_pid", 0))
        if owner and _alive(owner):
            continue
        progress(f"cleaning up a node run that ended without teardown ({state.get('netns')})")
        for pid in state.get("pids", []):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)
        stale = NetworkNamespace()
        stale.name, stale.host_link, stale._created = state["netns"], state["host_link"], True
        _teardown(
            netns=stale,
            workdir=Path(state["workdir"]),
            netns_before=set(state.get("netns_before", [])),
            keep=False,
        )
        state_file.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
