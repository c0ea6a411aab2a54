"""A network namespace of the test's own, joined to the host by a veth pair whose both ends it makes.

The node's components (kube-apiserver, kubelet, containerd, kube-proxy...) run inside it, so the
pods' bridge, their addresses and every iptables rule kube-proxy writes belong to the test and go
away with the namespace. The host end of the veth is the only address the test adds to the host:
servers that pods must reach (PostgreSQL, Kafka, the gateway) listen there, and the host reaches
the apiserver at the namespace's end. Nothing is routed anywhere else: the namespace has no default
route, so a pod cannot send a packet past the host end.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import secrets
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from testenv._common import ServiceUnavailable

#: The /16 from which each namespace takes one /30: host end .1, namespace end .2.
LINK_RANGE = ipaddress.IPv4Network("10.213.0.0/16")
NETNS_DIR = Path("/run/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise ServiceUnavailable(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _routes_in_use() -> list[ipaddress.IPv4Network]:
    out = _ip("-j", "-4", "route", "show", "table", "all").stdout
    networks = []
    for route in json.loads(out or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            try:
                networks.append(ipaddress.IPv4Network(dst, strict=False))
            except ValueError:
                continue
    return networks


def _free_link_subnet() -> ipaddress.IPv4Network:
    used = _routes_in_use()
    candidates = list(LINK_RANGE.subnets(new_prefix=30))
    random.shuffle(candidates)
    for subnet in candidates[:200]:
        if not any(subnet.overlaps(other) for other in used):
            return subnet
    raise ServiceUnavailable(f"no free /30 in {LINK_RANGE} for the node's veth pair")


class NetworkNamespace:
    """``ip netns add`` + a veth pair; ``wrap(cmd)`` runs a command inside (network only)."""

    def __init__(self, prefix: str = "adx") -> None:
        suffix = secrets.token_hex(3)
        self.name = f"{prefix}-{os.getpid()}-{suffix}"
        # Interface names are at most 15 characters.
        self.host_link = f"{prefix}h{suffix}"
        self.inner_link = f"{prefix}n{suffix}"
        self.subnet = ipaddress.IPv4Network("0.0.0.0/32")
        self.host_ip = ""
        self.node_ip = ""
        self._created = False

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name

    def create(self) -> NetworkNamespace:
        if os.geteuid() != 0:
            raise ServiceUnavailable("a real node needs root (network namespaces, mounts, cgroups)")
        self.subnet = _free_link_subnet()
        host, inner = list(self.subnet.hosts())[:2]
        self.host_ip, self.node_ip = str(host), str(inner)
        _ip("netns", "add", self.name)
        self._created = True
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.inner_link)
        _ip("link", "set", self.inner_link, "netns", self.name)
        _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        self.exec("ip", "link", "set", "lo", "up")
        self.exec("ip", "addr", "add", f"{self.node_ip}/30", "dev", self.inner_link)
        self.exec("ip", "link", "set", self.inner_link, "up")
        # Pods reach the host end through the namespace: it forwards (and kube-proxy needs it on).
        self.exec("sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        return self

    def wrap(self, cmd: Sequence[str | os.PathLike[str]]) -> list[str]:
        """The command, run in this namespace's network only.

        nsenter, not ``ip netns exec``: the latter also unshares the mount namespace, and then the
        kubelet's volume mounts would be invisible to containerd and runc.
        """
        return ["nsenter", f"--net={self.path}", "--", *map(str, cmd)]

    def exec(self, *cmd: str, timeout: float = 60) -> str:
        proc = subprocess.run(self.wrap(cmd), capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise ServiceUnavailable(f"{' '.join(cmd)} in {self.name} failed: {proc.stderr.strip()}")
        return proc.stdout

    def pids(self) -> list[int]:
        proc = _ip("netns", "pids", self.name, check=False)
        return [int(p) for p in proc.stdout.split() if p.isdigit()]

    def destroy(self) -> None:
        """Kill what still runs inside (by pid), then remove the veth pair and the namespace."""
        if not self._created:
            return
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        _ip("link", "del", self.host_link, check=False)
        _ip("netns", "del", self.name, check=False)
        self._created = False
