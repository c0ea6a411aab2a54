"""The kind workflow, as far as it can be checked without a container engine: the cluster config
decodes strictly with kind's own v1alpha4 types (a small Go program built against the
sigs.k8s.io/kind module), and scripts/kind-up.sh is valid bash that does the documented steps."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from testenv._common import cache_dir
from testenv.kube import bin_path, build_go_programs
from tests._fixtures import start_or_skip

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = ROOT / "hack" / "kind" / "cluster.yaml"
KIND_UP = ROOT / "scripts" / "kind-up.sh"
KINDCHECK = Path(__file__).parent / "kindcheck" / "main.go"
KIND_MODULE = "sigs.k8s.io/kind"
KIND_VERSION = "v0.33.0"


def ensure_kindcheck() -> Path:
    """Build (once per source and kind version) the kindcheck program into the test cache."""
    digest = hashlib.sha256(KINDCHECK.read_bytes()).hexdigest()[:12]
    key = f"kindcheck-{KIND_VERSION}-{digest}"
    out = bin_path("kindcheck", f"{KIND_VERSION}-{digest}")
    if not out.is_file():
        module_dir = cache_dir("build", key)
        shutil.copy(KINDCHECK, module_dir / "main.go")
        build_go_programs(
            key=key,
            module=KIND_MODULE,
            version=KIND_VERSION,
            programs={"kindcheck": "."},
            ldflags=["-s", "-w"],
            outputs={"kindcheck": out},
        )
    return out


@pytest.fixture(scope="module")
def kindcheck() -> Path:
    return start_or_skip(f"kind {KIND_VERSION} config types", ensure_kindcheck)


def _decode(kindcheck: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(kindcheck), str(path)], capture_output=True, text=True, timeout=60, check=False
    )


def test_cluster_config_decodes_with_kinds_own_types(kindcheck: Path) -> None:
    proc = _decode(kindcheck, CLUSTER_YAML)
    assert proc.returncode == 0, proc.stderr
    cluster: dict[str, Any] = json.loads(proc.stdout)
    assert cluster["name"] == "agent-dispatch"
    assert [node["role"] for node in cluster["nodes"]] == ["control-plane", "worker"]
    assert cluster["networking"]["apiServerAddress"] == "127.0.0.1"
    # kind filled in its defaults (the node image of this kind release, the pod subnet, ...).
    assert all(node["image"].startswith("kindest/node:") for node in cluster["nodes"])
    assert cluster["networking"]["podSubnet"]


def test_kind_rejects_what_it_does_not_know(kindcheck: Path, tmp_path: Path) -> None:
    """The decoder is strict, as kind's: a misspelt field or a wrong kind is an error."""
    text = CLUSTER_YAML.read_text()
    cases = {
        "typo.yaml": (text.replace("apiServerAddress", "apiServerAdress"), "apiServerAdress"),
        "kind.yaml": (text.replace("kind: Cluster", "kind: Clusterr"), "unknown kind"),
        "version.yaml": (text.replace("v1alpha4", "v1alpha9"), "unknown apiVersion"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_text(content)
        proc = _decode(kindcheck, path)
        assert proc.returncode != 0 and message in proc.stderr, (name, proc.stderr)


def test_kind_up_script_is_valid_and_does_the_documented_steps() -> None:
    subprocess.run(["bash", "-n", str(KIND_UP)], check=True)
    script = KIND_UP.read_text()
    for step in (
        'kind create cluster --name "$CLUSTER" --config hack/kind/cluster.yaml',
        'build -t "$IMAGE" .',
        'kind load docker-image "$IMAGE" --name "$CLUSTER"',
        'helm upgrade --install "$RELEASE" charts/agent-dispatch',
        "examples/agentdispatch-sqlite.yaml",
        "get agentdispatch",
    ):
        assert step in script, step
    # The defaults agree with the kind config, the chart and the example.
    cluster = yaml.safe_load(CLUSTER_YAML.read_text())
    assert f"CLUSTER=${{CLUSTER:-{cluster['name']}}}" in script
    chart = yaml.safe_load((ROOT / "charts" / "agent-dispatch" / "Chart.yaml").read_text())
    example = yaml.safe_load((ROOT / "examples" / "agentdispatch-sqlite.yaml").read_text())
    assert f"IMAGE=${{IMAGE:-agent-dispatch:{chart['appVersion']}}}" in script
    assert example["spec"]["worker"]["image"] == f"agent-dispatch:{chart['appVersion']}"


def test_kind_up_without_tools_fails_fast_with_a_clear_message(tmp_path: Path) -> None:
    """Without kind nor a container engine the script says which tool is missing (exit 3). The
    PATH is an empty directory, so this holds whatever the machine has installed (the script
    checks its tools with bash builtins before it runs any of them)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {"PATH": str(empty), "HOME": str(tmp_path)}
    bash = shutil.which("bash")
    assert bash is not None
    proc = subprocess.run(
        [bash, str(KIND_UP)], capture_output=True, text=True, env=env, timeout=30, check=False
    )
    assert proc.returncode == 3 and "kind is not on PATH" in proc.stderr, proc.stderr
