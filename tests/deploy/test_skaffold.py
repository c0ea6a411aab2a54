"""skaffold.yaml against skaffold's own JSON schema (shipped in skaffold's Go module, fetched through
the Go module proxy into the test cache; never copied into the project), with every profile applied,
and the Helm values it sets render the chart as intended."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from testenv._common import ServiceUnavailable, cache_dir, go_env, log_tail
from tests._fixtures import start_or_skip

ROOT = Path(__file__).resolve().parents[2]
SKAFFOLD_YAML = ROOT / "skaffold.yaml"
SKAFFOLD_MODULE = "github.com/GoogleContainerTools/skaffold/v2"
SKAFFOLD_VERSION = "v2.19.0"
#: The module's go.sum hash (h1:), pinned: the checksum database has no entry for this release, so
#: the download is verified against this value instead (GONOSUMDB for this one module only).
SKAFFOLD_SUM = "h1:qH0CVdT2qAT3PNCfbBXb8Rhb6H5tuWEyQOwK9VaePsE="


def download_module(module: str, version: str, *, expected_sum: str | None = None) -> Path:
    """``go mod download`` one module into the project's Go cache; returns its directory."""
    env = go_env()
    if expected_sum is not None:
        env["GONOSUMDB"] = module.rsplit("/v", 1)[0]
    log = cache_dir("build") / "modules.log"
    cmd = ["go", "mod", "download", "-json", f"{module}@{version}"]
    try:
        proc = subprocess.run(
            cmd, cwd=cache_dir("build"), env=env, capture_output=True, text=True, timeout=600, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServiceUnavailable(f"go mod download {module}@{version}: {exc}") from exc
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    try:
        info = json.loads(proc.stdout)
    except ValueError:
        raise ServiceUnavailable(f"go mod download {module}@{version} failed\n{log_tail(log)}") from None
    if proc.returncode != 0 or info.get("Error"):
        raise ServiceUnavailable(f"go mod download {module}@{version}: {info.get('Error')}")
    if expected_sum is not None and info.get("Sum") != expected_sum:
        raise AssertionError(f"{module}@{version} has sum {info.get('Sum')}, pinned {expected_sum}")
    return Path(info["Dir"])


@pytest.fixture(scope="module")
def skaffold_module() -> Path:
    return start_or_skip(
        "skaffold schema",
        lambda: download_module(SKAFFOLD_MODULE, SKAFFOLD_VERSION, expected_sum=SKAFFOLD_SUM),
    )


def _config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(SKAFFOLD_YAML.read_text())
    return config


def _pointer(path: str) -> list[str]:
    return [part.replace("~1", "/").replace("~0", "~") for part in path.lstrip("/").split("/")]


def apply_profile(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The config with profile ``name``'s JSON patches applied (add/replace/remove, as skaffold)."""
    result = copy.deepcopy(config)
    (profile,) = [p for p in config.get("profiles", []) if p["name"] == name]
    for patch in profile.get("patches", []):
        *parents, last = _pointer(patch["path"])
        node: Any = result
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if patch["op"] == "add":
            node[last] = patch["value"]
        elif patch["op"] == "replace":
            assert last in node, f"replace of a missing path {patch['path']}"
            node[last] = patch["value"]
        elif patch["op"] == "remove":
            del node[last]
        else:
            raise AssertionError(f"unsupported op {patch['op']}")
    for section in ("build", "deploy", "manifests", "portForward"):
        if section in profile:
            result[section] = profile[section]
    result.pop("profiles", None)
    return result


def _schema(module_dir: Path) -> dict[str, Any]:
    version = _config()["apiVersion"].split("/")[1]
    path = module_dir / "docs-v2" / "content" / "en" / "schemas" / f"{version}.json"
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


def test_skaffold_yaml_uses_the_newest_schema_of_the_pinned_skaffold(skaffold_module: Path) -> None:
    latest = (skaffold_module / "pkg" / "skaffold" / "schema" / "latest" / "config.go").read_text()
    match = re.search(r'const Version string = "(skaffold/[^"]+)"', latest)
    assert match is not None
    assert _config()["apiVersion"] == match.group(1)


def test_skaffold_yaml_validates_against_skaffolds_schema(skaffold_module: Path) -> None:
    import jsonschema

    schema = _schema(skaffold_module)
    validator = jsonschema.Draft7Validator(schema)
    config = _config()
    assert [e.message for e in validator.iter_errors(config)] == []
    for profile in ("dev", "kind"):
        assert [e.message for e in validator.iter_errors(apply_profile(config, profile))] == [], profile

    # The schema is strict enough to catch a misspelt key at any depth.
    for path, typo in ((["deploy", "helm", "releases", 0], "chartpath"), (["build", "local"], "pushh")):
        broken = copy.deepcopy(config)
        node: Any = broken
        for part in path:
            node = node[part]
        node[typo] = "x"
        assert list(validator.iter_errors(broken)), typo


def test_skaffold_yaml_refers_to_real_files() -> None:
    config = _config()
    (artifact,) = config["build"]["artifacts"]
    assert (ROOT / artifact.get("context", ".") / artifact["docker"]["dockerfile"]).is_file()
    assert artifact["image"] == "agent-dispatch"  # by name only: no registry host
    (release,) = config["deploy"]["helm"]["releases"]
    assert (ROOT / release["chartPath"] / "Chart.yaml").is_file()
    names = {p["name"] for p in config["profiles"]}
    assert names == {"dev", "kind"}


def _helm_args(config: dict[str, Any]) -> list[str]:
    """The --set flags skaffold's helm deployer passes, with its image template variables filled in
    as skaffold fills them for the image "agent-dispatch" (non-alphanumerics become "_")."""
    (release,) = config["deploy"]["helm"]["releases"]
    filled = {"IMAGE_REPO_agent_dispatch": "agent-dispatch", "IMAGE_TAG_agent_dispatch": "abc1234"}
    args: list[str] = []
    for key, value in release.get("setValueTemplates", {}).items():
        text = re.sub(r"\{\{\s*\.(\w+)\s*\}\}", lambda m: filled[m.group(1)], str(value))
        args += ["--set", f"{key}={text}"]
    for key, value in release.get("setValues", {}).items():
        args += ["--set", f"{key}={json.dumps(value) if isinstance(value, bool) else value}"]
    return args


@pytest.mark.kube
@pytest.mark.parametrize("profile", [None, "dev", "kind"])
def test_skaffold_helm_values_render_the_chart(helm_bin: Path, tmp_path: Path, profile: str | None) -> None:
    from tests.helm._support import by_kind, manifests, render

    config = _config() if profile is None else apply_profile(_config(), profile)
    docs = manifests(render(helm_bin, tmp_path / "helm", "agent-dispatch", *_helm_args(config)).stdout)
    deployments = {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")}
    # The operator, and the external-metrics API (metricsApi.enabled): both run the built image.
    assert {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in deployments.values()} == {
        "agent-dispatch:abc1234"
    }
    deployment = deployments["agent-dispatch-operator"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    examples = by_kind(docs, "AgentDispatch")
    assert len(examples) == (0 if profile is None else 1)
    if profile == "kind":
        assert container["imagePullPolicy"] == "Never"
        assert examples[0]["spec"]["worker"]["imagePullPolicy"] == "Never"
        assert config["deploy"]["kubeContext"] == "kind-agent-dispatch"
        cluster = yaml.safe_load((ROOT / "hack" / "kind" / "cluster.yaml").read_text())
        assert config["deploy"]["kubeContext"] == f"kind-{cluster['name']}"
    if profile == "dev":
        assert {e["name"]: e["value"] for e in container["env"]}["AGENT_DISPATCH_LOG_LEVEL"] == "DEBUG"
