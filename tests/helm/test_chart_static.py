"""The chart without a cluster: CRD single source, values schema, lint, and what each option renders."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from testenv.helm import run_helm
from tests.helm._support import CHART, CRD_FILE, ROOT, by_kind, manifests, render

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DASHBOARD_METRICS = (
    "agent_dispatch_queue_depth",
    "agent_dispatch_turns_total",
    "agent_dispatch_lease_failures_total",
    "agent_dispatch_worker_heartbeat_timestamp_seconds",
    "agent_dispatch_claim_duration_seconds_bucket",
)
#: Schema objects that are Kubernetes types passed through to the API server, which checks them.
PASSTHROUGH = {"global", "nodeAffinity", "podAffinity", "podAntiAffinity"}


def _home(tmp_path: Path) -> Path:
    return tmp_path / "helm-home"


def _rules(role: dict[str, Any]) -> list[dict[str, Any]]:
    return list(role.get("rules") or [])


def _operator_side(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Everything but the metrics API's objects (tested on their own below)."""
    return [
        d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") != "metrics-api"
    ]


def _metrics_api_side(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "metrics-api"
    ]


def _verbs_on(rules: list[dict[str, Any]], group: str, resource: str) -> set[str]:
    return {
        verb
        for rule in rules
        if group in rule["apiGroups"] and resource in rule["resources"]
        for verb in rule["verbs"]
    }


# -- files ------------------------------------------------------------------------------------------


def test_chart_crd_is_byte_identical_to_the_single_source() -> None:
    chart_crd = CHART / "crds" / CRD_FILE.name
    assert [p.name for p in (CHART / "crds").iterdir()] == [CRD_FILE.name]
    assert chart_crd.read_bytes() == CRD_FILE.read_bytes(), "run scripts/sync-crd.sh"


def test_sync_script_copies_the_crd(tmp_path: Path) -> None:
    import shutil
    import subprocess

    # Run the real script on a copy of the layout it expects, with a stale chart copy.
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "sync-crd.sh", tmp_path / "scripts" / "sync-crd.sh")
    (tmp_path / "crds").mkdir()
    shutil.copy(CRD_FILE, tmp_path / "crds" / CRD_FILE.name)
    stale = tmp_path / "charts" / "agent-dispatch" / "crds" / CRD_FILE.name
    stale.parent.mkdir(parents=True)
    stale.write_text("stale: true\n")
    script = tmp_path / "scripts" / "sync-crd.sh"

    check = subprocess.run(["bash", str(script), "--check"], capture_output=True, text=True, check=False)
    assert check.returncode == 1 and "differs" in check.stderr
    subprocess.run(["bash", str(script)], check=True, capture_output=True)
    assert stale.read_bytes() == CRD_FILE.read_bytes()
    assert subprocess.run(["bash", str(script), "--check"], capture_output=True, check=False).returncode == 0


def _objects_without_closed_properties(node: Any, path: str = "$") -> list[str]:
    found: list[str] = []
    if isinstance(node, dict):
        if (
            node.get("type") == "object"
            and "properties" in node
            and node.get("additionalProperties") is not False
        ):
            found.append(path)
        if node.get("type") == "object" and "properties" not in node and "additionalProperties" not in node:
            name = path.rsplit(".", 1)[-1]
            if name not in PASSTHROUGH:
                found.append(f"{path} (open object)")
        for key, value in node.items():
            found += _objects_without_closed_properties(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _objects_without_closed_properties(value, f"{path}[{index}]")
    return found


def test_values_schema_closes_every_object() -> None:
    """additionalProperties: false on every object with named keys; maps have typed values."""
    assert _objects_without_closed_properties(SCHEMA) == []


def test_values_yaml_is_valid_and_documents_every_schema_key() -> None:
    import jsonschema

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.validate(values, SCHEMA)

    def keys(schema: dict[str, Any], prefix: str = "") -> set[str]:
        out: set[str] = set()
        for name, sub in (schema.get("properties") or {}).items():
            out.add(prefix + name)
            if "properties" in sub:
                out |= keys(sub, f"{prefix}{name}.")
        return out

    def value_keys(node: Any, prefix: str = "") -> set[str]:
        out: set[str] = set()
        if isinstance(node, dict):
            for name, sub in node.items():
                out.add(prefix + name)
                if isinstance(sub, dict) and sub and not prefix.endswith(("labels.", "Selector.")):
                    out |= value_keys(sub, f"{prefix}{name}.")
        return out

    # The Affinity sub-objects are Kubernetes types: the default is an empty affinity.
    schema_keys = {k for k in keys(SCHEMA) if k != "global" and not k.startswith("operator.affinity.")}
    documented = value_keys(values)
    # Every schema key has a default in values.yaml (nothing hidden), and values.yaml has no key
    # the schema does not describe (besides the contents of free-form maps).
    assert schema_keys - documented == set()
    structural = {
        k
        for k in documented
        if not k.startswith(("operator.resources.", "metricsApi.resources.", "grafanaDashboard.labels."))
    }
    assert structural - schema_keys == set()


def test_grafana_dashboard_shows_the_documented_metrics() -> None:
    dashboard = json.loads((CHART / "dashboards" / "agent-dispatch.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert titles == [
        "Queue depth",
        "Turns per second by outcome",
        "Lease failures",
        "Live workers",
        "Claim latency",
    ]
    for metric in DASHBOARD_METRICS:
        assert any(metric in expr for expr in exprs), metric
    assert any("by (outcome)" in expr for expr in exprs)
    assert any("by (reason)" in expr for expr in exprs)
    assert any("histogram_quantile" in expr for expr in exprs)


# -- helm lint and schema ---------------------------------------------------------------------------


@pytest.mark.kube
def test_helm_lint_strict_passes(helm_bin: Path, tmp_path: Path) -> None:
    for extra in (
        [],
        [
            "--set",
            "rbac.clusterWide=true,example.enabled=true,grafanaDashboard.enabled=true,"
            "metrics.serviceMonitor.enabled=true",
        ],
    ):
        proc = run_helm("lint", "--strict", str(CHART), *extra, helm=helm_bin, home=_home(tmp_path))
        assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
        assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


@pytest.mark.kube
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "bogus=1"], "bogus"),
        (["--set", "operator.bogus=1"], "bogus"),
        (["--set", "rbac.secretname[0]=db"], "secretname"),
        (["--set", "metrics.serviceMonitor.intervall=10s"], "intervall"),
        (["--set", "rbac.clusterWide=yes"], "clusterWide"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "operator.resources.limits=null"], "limits"),
        (["--set", "example.replicas=2"], "replicas"),
    ],
)
def test_values_schema_rejects_unknown_keys_and_bad_values(
    helm_bin: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    proc = render(helm_bin, _home(tmp_path), "ns", *args, check=False)
    assert proc.returncode != 0
    assert "schema" in proc.stderr.lower() and message in proc.stderr, proc.stderr


# -- what renders -----------------------------------------------------------------------------------


@pytest.mark.kube
def test_defaults_are_namespaced_least_privilege_and_hardened(helm_bin: Path, tmp_path: Path) -> None:
    everything = manifests(render(helm_bin, _home(tmp_path), "team-a").stdout)
    docs = _operator_side(everything)
    kinds = sorted(f"{doc['kind']}/{doc['metadata']['name']}" for doc in docs)
    assert kinds == sorted(
        [
            "Deployment/agent-dispatch-operator",
            "Role/agent-dispatch-operator",
            "Role/agent-dispatch-worker",
            "RoleBinding/agent-dispatch-operator",
            "RoleBinding/agent-dispatch-worker",
            "Service/agent-dispatch-operator-metrics",
            "ServiceAccount/agent-dispatch",
            "ServiceAccount/agent-dispatch-worker",
        ]
    )
    assert all(doc["metadata"]["namespace"] == "team-a" for doc in docs)

    (deployment,) = by_kind(docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["agent-dispatch-operator"]
    assert container["args"] == ["--namespace=team-a", "--liveness=http://0.0.0.0:8080/healthz"]
    assert container["image"] == "agent-dispatch:0.1.0"
    assert pod["serviceAccountName"] == "agent-dispatch"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert set(container["resources"]) == {"requests", "limits"}
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])

    role = next(d for d in by_kind(docs, "Role") if d["metadata"]["name"] == "agent-dispatch-operator")
    rules = _rules(role)
    assert _verbs_on(rules, "", "secrets") == set()  # no Secret is readable by default
    assert _verbs_on(rules, "agentdispatch.io", "agentdispatches") == {"get", "list", "watch", "patch"}
    assert _verbs_on(rules, "agentdispatch.io", "agentdispatches/status") == {"patch"}
    assert _verbs_on(rules, "coordination.k8s.io", "leases") == {"list", "watch"}
    assert _verbs_on(rules, "", "events") == {"create"}
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
        assert "rbac.authorization.k8s.io" not in rule["apiGroups"]

    worker_role = next(d for d in by_kind(docs, "Role") if d["metadata"]["name"] == "agent-dispatch-worker")
    assert _rules(worker_role) == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "patch", "delete"],
        }
    ]


@pytest.mark.kube
def test_secret_names_become_resource_names(helm_bin: Path, tmp_path: Path) -> None:
    docs = manifests(
        render(
            helm_bin, _home(tmp_path), "team-a", "--set", "rbac.secretNames={db-dsn,kafka-bootstrap}"
        ).stdout
    )
    role = next(d for d in by_kind(docs, "Role") if d["metadata"]["name"] == "agent-dispatch-operator")
    secret_rules = [r for r in _rules(role) if "secrets" in r["resources"]]
    assert secret_rules == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["db-dsn", "kafka-bootstrap"],
            "verbs": ["get"],
        }
    ]


@pytest.mark.kube
def test_watch_namespaces_get_a_role_each(helm_bin: Path, tmp_path: Path) -> None:
    docs = manifests(
        render(helm_bin, _home(tmp_path), "ops", "--set", "rbac.watchNamespaces={team-a,team-b}").stdout
    )
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in by_kind(docs, "Role")}
    assert roles == {
        (ns, f"agent-dispatch-{who}")
        for ns in ("team-a", "team-b")
        for who in ("operator", "worker", "metrics-api")
    }
    api = next(
        d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "agent-dispatch-metrics-api"
    )
    api_args = api["spec"]["template"]["spec"]["containers"][0]["args"]
    assert api_args[:2] == ["--namespace=team-a", "--namespace=team-b"]
    docs = _operator_side(docs)
    for binding in by_kind(docs, "RoleBinding"):
        if binding["metadata"]["name"] == "agent-dispatch-operator":
            assert binding["subjects"] == [
                {"kind": "ServiceAccount", "name": "agent-dispatch", "namespace": "ops"}
            ]
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["--namespace=team-a", "--namespace=team-b"]
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")


@pytest.mark.kube
def test_cluster_wide_mode_uses_one_cluster_role(helm_bin: Path, tmp_path: Path) -> None:
    everything = manifests(render(helm_bin, _home(tmp_path), "ops", "--set", "rbac.clusterWide=true").stdout)
    api_roles = {d["metadata"]["name"] for d in by_kind(_metrics_api_side(everything), "ClusterRole")}
    assert "agent-dispatch-metrics-api" in api_roles  # reads AgentDispatches everywhere, too
    docs = _operator_side(everything)
    (cluster_role,) = by_kind(docs, "ClusterRole")
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "agent-dispatch", "namespace": "ops"}]
    rules = _rules(cluster_role)
    assert _verbs_on(rules, "apiextensions.k8s.io", "customresourcedefinitions") == {"get", "list", "watch"}
    assert _verbs_on(rules, "", "secrets") == set()
    assert _verbs_on(rules, "", "namespaces") == set()
    for rule in rules:
        assert "rbac.authorization.k8s.io" not in rule["apiGroups"] and "*" not in rule["verbs"]
    operator_roles = [d for d in by_kind(docs, "Role") if d["metadata"]["name"].endswith("-operator")]
    assert operator_roles == []
    (deployment,) = by_kind(docs, "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][0] == "--all-namespaces"


@pytest.mark.kube
def test_service_monitor_renders_only_where_the_api_exists(helm_bin: Path, tmp_path: Path) -> None:
    home = _home(tmp_path)
    without_api = manifests(
        render(helm_bin, home, "ns", "--set", "metrics.serviceMonitor.enabled=true").stdout
    )
    assert by_kind(without_api, "ServiceMonitor") == []

    with_api = manifests(
        render(
            helm_bin,
            home,
            "ns",
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--api-versions",
            "monitoring.coreos.com/v1",
        ).stdout
    )
    monitors = {d["metadata"]["name"]: d for d in by_kind(with_api, "ServiceMonitor")}
    assert set(monitors) == {
        "agent-dispatch-operator",
        "agent-dispatch-workers",
        "agent-dispatch-metrics-api",
    }
    depth = monitors["agent-dispatch-metrics-api"]["spec"]
    # The depth series keeps its own namespace label (the AgentDispatch's, not the scraped pod's).
    assert depth["endpoints"] == [
        {
            "port": "metrics",
            "path": "/metrics",
            "honorLabels": True,
            "interval": "30s",
            "scrapeTimeout": "10s",
        }
    ]
    workers = monitors["agent-dispatch-workers"]["spec"]
    assert workers["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "agent-dispatch",
        "agent-dispatch.io/component": "worker",
    }
    assert workers["endpoints"][0]["port"] == "metrics"

    disabled = manifests(render(helm_bin, home, "ns", "--api-versions", "monitoring.coreos.com/v1").stdout)
    assert by_kind(disabled, "ServiceMonitor") == []


@pytest.mark.kube
def test_worker_service_monitor_matches_what_the_operator_renders(helm_bin: Path, tmp_path: Path) -> None:
    from agent_dispatch.operator import desired

    body = {
        "apiVersion": "agentdispatch.io/v1alpha1",
        "kind": "AgentDispatch",
        "metadata": {"name": "example", "namespace": "ns", "uid": "u"},
        "spec": {"backend": "sqlite", "worker": {"image": "agent-dispatch:0.1.0"}},
    }
    service = desired(body).service
    docs = manifests(
        render(
            helm_bin,
            _home(tmp_path),
            "ns",
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--api-versions",
            "monitoring.coreos.com/v1",
        ).stdout
    )
    monitor = next(d for d in by_kind(docs, "ServiceMonitor") if d["metadata"]["name"].endswith("-workers"))
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert set(monitor["spec"]["targetLabels"]) <= set(service["metadata"]["labels"])


@pytest.mark.kube
def test_dashboard_and_example_are_optional(helm_bin: Path, tmp_path: Path) -> None:
    home = _home(tmp_path)
    docs = manifests(
        render(helm_bin, home, "ns", "--set", "grafanaDashboard.enabled=true,example.enabled=true").stdout
    )
    (config_map,) = by_kind(docs, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["agent-dispatch.json"])
    assert dashboard["uid"] == "agent-dispatch"
    (example,) = by_kind(docs, "AgentDispatch")
    assert example["spec"]["backend"] == "sqlite"
    assert example["spec"]["worker"]["serviceAccountName"] == "agent-dispatch-worker"
    assert example["spec"]["worker"]["image"] == "agent-dispatch:0.1.0"

    plain = manifests(render(helm_bin, home, "ns").stdout)
    assert by_kind(plain, "ConfigMap") == [] and by_kind(plain, "AgentDispatch") == []


@pytest.mark.kube
def test_image_digest_and_tag(helm_bin: Path, tmp_path: Path) -> None:
    digest = "sha256:" + "ab" * 32
    docs = manifests(render(helm_bin, _home(tmp_path), "ns", "--set", f"image.digest={digest}").stdout)
    images = {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in by_kind(docs, "Deployment")}
    assert images == {f"agent-dispatch@{digest}"}  # the operator and the metrics API, one image
    docs = manifests(render(helm_bin, _home(tmp_path), "ns", "--set", "image.tag=1.2.3").stdout)
    images = {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in by_kind(docs, "Deployment")}
    assert images == {"agent-dispatch:1.2.3"}


@pytest.mark.kube
def test_notes_give_next_steps(helm_bin: Path, tmp_path: Path) -> None:
    # helm template does not print NOTES.txt; --show-only can render it like any template.
    text = render(helm_bin, _home(tmp_path), "team-a", "--show-only", "templates/NOTES.txt", check=False)
    if text.returncode != 0:  # helm refuses NOTES in --show-only: render it through install --dry-run
        text = run_helm(
            "install",
            "agent-dispatch",
            str(CHART),
            "--namespace",
            "team-a",
            "--dry-run=client",
            helm=helm_bin,
            home=_home(tmp_path),
        )
    notes = text.stdout
    assert "kubectl -n team-a rollout status deployment/agent-dispatch-operator" in notes
    assert "kind: AgentDispatch" in notes
    assert "kubectl -n team-a get agentdispatch" in notes
    assert "helm uninstall agent-dispatch -n team-a" in notes
    assert "kubectl delete crd agentdispatches.agentdispatch.io" in notes


# -- no registry host names -------------------------------------------------------------------------

REGISTRY_HOST = re.compile(
    r"\b(docker\.io|index\.docker\.io|registry-1\.docker\.io|gcr\.io|[a-z0-9-]+\.gcr\.io|ghcr\.io|quay\.io|"
    r"registry\.k8s\.io|k8s\.gcr\.io|public\.ecr\.aws|[a-z0-9-]+\.dkr\.ecr\.[a-z0-9-]+\.amazonaws\.com|"
    r"mcr\.microsoft\.com|[a-z0-9-]+\.azurecr\.io|registry\.gitlab\.com|pkg\.dev|pypi\.org|"
    r"files\.pythonhosted\.org|proxy\.golang\.org)\b"
)
DEPLOY_FILES = (
    "Dockerfile",
    ".dockerignore",
    "skaffold.yaml",
    "docker/install.sh",
    "scripts/kind-up.sh",
    "scripts/sync-crd.sh",
    "hack/kind/cluster.yaml",
    "examples/agentdispatch-sqlite.yaml",
    "docs/operations.md",
    "README.md",
)


def test_no_registry_host_names_in_the_deployment_files() -> None:
    paths = [ROOT / name for name in DEPLOY_FILES]
    paths += [p for p in CHART.rglob("*") if p.is_file()]
    offenders = {
        str(p.relative_to(ROOT)): REGISTRY_HOST.findall(p.read_text())
        for p in paths
        if REGISTRY_HOST.search(p.read_text())
    }
    assert offenders == {}


@pytest.mark.kube
def test_metrics_api_is_registered_with_its_own_ca_and_least_privilege(
    helm_bin: Path, tmp_path: Path
) -> None:
    import base64

    from cryptography import x509

    docs = manifests(render(helm_bin, _home(tmp_path), "team-a").stdout)
    api = _metrics_api_side(docs)
    (service,) = by_kind(api, "APIService")
    assert service["metadata"]["name"] == "v1beta1.external.metrics.k8s.io"
    assert service["spec"]["service"] == {
        "name": "agent-dispatch-metrics-api",
        "namespace": "team-a",
        "port": 443,
    }
    assert service["spec"]["insecureSkipTLSVerify"] is False
    (secret,) = by_kind(api, "Secret")
    assert secret["data"]["ca.crt"] == service["spec"]["caBundle"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(service["spec"]["caBundle"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    assert cert.issuer == ca.subject
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert "agent-dispatch-metrics-api.team-a.svc" in names  # the name the aggregator verifies

    (deployment,) = by_kind(api, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["agent-dispatch", "metrics-api"]
    assert "--namespace=team-a" in container["args"]
    assert pod["serviceAccountName"] == "agent-dispatch-metrics-api"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # No database credentials: nothing from a Secret but the serving certificate.
    assert not any("valueFrom" in env for env in container.get("env", []))
    assert [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v] == [
        "agent-dispatch-metrics-api-tls"
    ]

    cluster_roles = {d["metadata"]["name"]: _rules(d) for d in by_kind(api, "ClusterRole")}
    assert cluster_roles == {
        "agent-dispatch-metrics-api-auth-delegator": [
            {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
            {
                "apiGroups": ["authorization.k8s.io"],
                "resources": ["subjectaccessreviews"],
                "verbs": ["create"],
            },
        ],
        "agent-dispatch-metrics-api-reader": [
            {"apiGroups": ["external.metrics.k8s.io"], "resources": ["*"], "verbs": ["get", "list"]}
        ],
    }
    hpa_binding = next(
        d for d in by_kind(api, "ClusterRoleBinding") if d["metadata"]["name"].endswith("-hpa-controller")
    )
    assert hpa_binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "horizontal-pod-autoscaler", "namespace": "kube-system"}
    ]
    reader = next(d for d in by_kind(api, "RoleBinding") if d["metadata"]["namespace"] == "kube-system")
    assert reader["roleRef"]["name"] == "extension-apiserver-authentication-reader"
    (role,) = by_kind(api, "Role")
    assert role["metadata"]["namespace"] == "team-a"
    assert _rules(role) == [
        {
            "apiGroups": ["agentdispatch.io"],
            "resources": ["agentdispatches"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    # Everything cluster-scoped the chart renders by default belongs to the metrics API.
    cluster_scoped = [d for d in docs if d["kind"] in {"ClusterRole", "ClusterRoleBinding", "APIService"}]
    assert cluster_scoped and all(d in api for d in cluster_scoped)

    off = manifests(render(helm_bin, _home(tmp_path), "team-a", "--set", "metricsApi.enabled=false").stdout)
    assert _metrics_api_side(off) == []
    assert not [d for d in off if d["kind"] in {"ClusterRole", "ClusterRoleBinding", "APIService"}]


@pytest.mark.kube
def test_metrics_api_can_use_an_existing_certificate(helm_bin: Path, tmp_path: Path) -> None:
    home = _home(tmp_path)
    docs = manifests(
        render(
            helm_bin,
            home,
            "ns",
            "--set",
            "metricsApi.tls.existingSecret=my-cert,metricsApi.tls.caBundle=Q0E=",
        ).stdout
    )
    assert by_kind(docs, "Secret") == []
    (service,) = by_kind(docs, "APIService")
    assert service["spec"]["caBundle"] == "Q0E="
    api = next(
        d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "agent-dispatch-metrics-api"
    )
    assert [
        v["secret"]["secretName"] for v in api["spec"]["template"]["spec"]["volumes"] if "secret" in v
    ] == ["my-cert"]
    missing = render(helm_bin, home, "ns", "--set", "metricsApi.tls.existingSecret=my-cert", check=False)
    assert missing.returncode != 0 and "metricsApi.tls.caBundle is required" in missing.stderr
