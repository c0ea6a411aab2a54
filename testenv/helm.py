"""helm for tests, built from its Go module (helm.sh/helm/v4) and cached by version."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from testenv._common import ServiceUnavailable, cache_dir
from testenv.kube import bin_path, build_go_programs

HELM_VERSION = "v4.3.2"
HELM_TIMEOUT_S = 120.0


def ensure_helm() -> Path:
    """Build (once) and return the helm binary at HELM_VERSION."""
    out = bin_path("helm", HELM_VERSION)
    if not out.is_file():
        build_go_programs(
            key=f"helm-{HELM_VERSION}",
            module="helm.sh/helm/v4",
            version=HELM_VERSION,
            programs={"helm": "helm.sh/helm/v4/cmd/helm"},
            # What helm's Makefile stamps for a tagged release: the version, no "unreleased" metadata.
            ldflags=[
                "-s",
                "-w",
                f"-X helm.sh/helm/v4/internal/version.version={HELM_VERSION}",
                "-X helm.sh/helm/v4/internal/version.metadata=",
                "-X helm.sh/helm/v4/internal/version.gitTreeState=clean",
            ],
            outputs={"helm": out},
        )
    return out


def helm_env(home: Path | None = None, kubeconfig: Path | None = None) -> dict[str, str]:
    """Environment that keeps helm's config, cache and data out of the user's home directory."""
    root = home or cache_dir("helm-home")
    env = dict(os.environ)
    env.update(
        {
            "HELM_CACHE_HOME": str(root / "cache"),
            "HELM_CONFIG_HOME": str(root / "config"),
            "HELM_DATA_HOME": str(root / "data"),
        }
    )
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return env


def run_helm(
    *args: str,
    helm: Path | None = None,
    home: Path | None = None,
    kubeconfig: Path | None = None,
    timeout: float = HELM_TIMEOUT_S,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run helm with an isolated home (and optionally a kubeconfig); errors carry helm's stderr."""
    cmd = [str(helm or ensure_helm()), *args]
    try:
        proc = subprocess.run(
            cmd, env=helm_env(home, kubeconfig), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise ServiceUnavailable(f"helm {' '.join(args)} timed out after {timeout}s") from exc
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def helm_version(helm: Path | None = None) -> str:
    """The version the built helm reports, e.g. ``v4.3.2``."""
    proc = run_helm("version", "--template", "{{ .Version }}", helm=helm, timeout=30)
    return proc.stdout.strip()
