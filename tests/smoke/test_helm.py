"""helm is real: the pinned version, built from its Go module, renders a chart."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from testenv.helm import HELM_VERSION, helm_version, run_helm

pytestmark = pytest.mark.kube

CONFIGMAP_TEMPLATE = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-{{ .Chart.Name }}
  namespace: {{ .Release.Namespace }}
  labels:
    app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
data:
  message: {{ .Values.message | quote }}
  replicas: {{ .Values.replicas | quote }}
"""


def _write_chart(root: Path) -> Path:
    chart = root / "smoke"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        yaml.safe_dump({"apiVersion": "v2", "name": "smoke", "version": "0.1.0", "appVersion": "1.2.3"})
    )
    (chart / "values.yaml").write_text(yaml.safe_dump({"message": "hello", "replicas": 2}))
    (chart / "templates" / "configmap.yaml").write_text(CONFIGMAP_TEMPLATE)
    return chart


def test_helm_reports_the_pinned_version(helm_bin: Path) -> None:
    assert helm_version(helm_bin) == HELM_VERSION
    assert f'Version:"{HELM_VERSION}"' in run_helm("version", helm=helm_bin).stdout


def test_helm_template_renders_a_throwaway_chart(helm_bin: Path, tmp_path: Path) -> None:
    chart = _write_chart(tmp_path)

    rendered = run_helm(
        "template",
        "rel",
        str(chart),
        "--namespace",
        "smoke-ns",
        "--set",
        "message=world",
        helm=helm_bin,
        home=tmp_path / "helm",
    ).stdout

    manifests = [doc for doc in yaml.safe_load_all(rendered) if doc]
    assert manifests == [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "rel-smoke",
                "namespace": "smoke-ns",
                "labels": {"app.kubernetes.io/version": "1.2.3"},
            },
            "data": {"message": "world", "replicas": "2"},
        }
    ]
