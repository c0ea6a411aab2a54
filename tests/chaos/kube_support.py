"""The AgentDispatch CRD on the test API server, for tests outside tests/kube (whose conftest
fixtures are not visible here)."""

from __future__ import annotations

from typing import Any

_INSTALLED: set[str] = set()


def install_crd(kube: Any) -> None:
    """The project's CRD, installed and served, as tests/kube/conftest.py does (once per server)."""
    from agent_dispatch import k8s_names
    from tests.kube.conftest import CRD_FILE, CRD_NAME, wait_for

    if kube.server in _INSTALLED:
        return
    kube.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    kube.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    wait_for(
        lambda: kube.kubectl("get", k8s_names.PLURAL, "-A", check=False).returncode == 0,
        30,
        what="served CRD",
    )
    _INSTALLED.add(kube.server)
