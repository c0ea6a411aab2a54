"""Unit tests of the operator's pure functions (no cluster): rendering, validation, status."""

from __future__ import annotations

import copy
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent_dispatch import k8s_names
from agent_dispatch.operator import _desired, _kafka, _reconcile, _spec, _status, _validate
from agent_dispatch.operator._cluster import ClusterError, secret_value
from agent_dispatch.settings import ENV_NAMES

CRD_PATH = Path(__file__).resolve().parents[1] / "crds" / "agentdispatch.yaml"
UID = "0b6c3a52-1111-4222-8333-444455556666"


def body(
    spec: dict[str, Any] | None = None, *, name: str = "demo", status: dict[str, Any] | None = None
) -> dict[str, Any]:
    spec = spec if spec is not None else kafka_spec()
    result: dict[str, Any] = {
        "apiVersion": k8s_names.API_VERSION,
        "kind": k8s_names.KIND,
        "metadata": {
            "name": name,
            "namespace": "team-a",
            "uid": UID,
            "generation": 3,
            "labels": {"team": "a"},
        },
        "spec": spec,
    }
    if status is not None:
        result["status"] = status
    return result


def kafka_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "backend": "kafka",
        "partitions": 6,
        "maxDepth": 5000,
        "claimTtlSeconds": 60,
        "renewIntervalSeconds": 10,
        "kafka": {"bootstrapServersSecretRef": {"name": "kafka", "key": "servers"}, "topic": "turns"},
        "postgres": {"dsnSecretRef": {"name": "pg", "key": "dsn"}},
        "signingKeySecretRef": {"name": "signing", "key": "key"},
        "worker": {"image": "example.invalid/agent-dispatch:1.2.3", "replicas": 2, "concurrency": 8},
    }
    spec.update(overrides)
    return spec


def postgres_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "backend": "postgres",
        "postgres": {"dsnSecretRef": {"name": "pg", "key": "dsn"}},
        "signingKeySecretRef": {"name": "signing", "key": "key"},
        "worker": {"image": "img:1"},
    }
    spec.update(overrides)
    return spec


def env_of(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {item["name"]: item for item in container["env"]}


# --- the CRD file ---------------------------------------------------------------------------------


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_crd_names_match_the_shared_names() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    assert crd["metadata"]["name"] == f"{k8s_names.PLURAL}.{k8s_names.GROUP}"
    assert crd["spec"]["names"]["kind"] == k8s_names.KIND
    assert crd["spec"]["names"]["shortNames"] == [k8s_names.SHORT_NAME]
    version = crd["spec"]["versions"][0]
    assert version["name"] == k8s_names.VERSION
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Backend", "Depth", "Workers", "Ready", "Age"]


def test_crd_reserved_env_list_is_the_operators() -> None:
    worker = crd_schema()["properties"]["spec"]["properties"]["worker"]
    rule = worker["x-kubernetes-validations"][0]["rule"]
    listed = set(
        rule[rule.index("[") + 1 : rule.index("]")]
        .replace("'", "")
        .replace("\n", " ")
        .replace(",", " ")
        .split()
    )
    assert listed == set(_spec.RESERVED_ENV)


def test_crd_defaults_match_the_parser_defaults() -> None:
    props = crd_schema()["properties"]["spec"]["properties"]
    parsed = _spec.parse({"worker": {"image": "x"}})
    assert props["backend"]["default"] == parsed.backend
    assert props["partitions"]["default"] == parsed.partitions
    assert props["maxDepth"]["default"] == parsed.max_depth
    assert props["claimTtlSeconds"]["default"] == parsed.claim_ttl_s
    assert props["renewIntervalSeconds"]["default"] == parsed.renew_interval_s
    worker = props["worker"]["properties"]
    assert worker["replicas"]["default"] == parsed.worker.replicas
    assert worker["concurrency"]["default"] == parsed.worker.concurrency
    assert worker["metricsPort"]["default"] == parsed.worker.metrics_port
    assert worker["resources"]["default"] == parsed.worker.resources
    assert worker["shutdownGraceSeconds"]["default"] == parsed.worker.shutdown_grace_s
    auto = props["autoscaling"]["properties"]
    assert auto["maxReplicas"]["default"] == parsed.autoscaling.max_replicas
    assert auto["targetDepthPerReplica"]["default"] == parsed.autoscaling.target_depth_per_replica


def test_crd_has_no_inline_connection_fields() -> None:
    text = json.dumps(crd_schema())
    for forbidden in ('"dsn"', '"password"', '"connectionString"', '"stateDbUri"'):
        assert forbidden not in text


# --- rendering ------------------------------------------------------------------------------------


def test_worker_env_uses_the_settings_variable_names() -> None:
    rendered = _desired.desired(body())
    env = env_of(rendered.deployment)
    settings_names = set(ENV_NAMES.values())
    assert set(env) <= settings_names, set(env) - settings_names
    assert env["TASK_QUEUE_BACKEND"]["value"] == "kafka"
    assert env["AGENT_TURNS_PARTITIONS"]["value"] == "6"
    assert env["AGENT_DISPATCH_MAX_DEPTH"]["value"] == "5000"
    assert env["AGENT_DISPATCH_CLAIM_TTL_S"]["value"] == "60"
    assert env["AGENT_DISPATCH_RENEW_INTERVAL_S"]["value"] == "10"
    assert env["AGENT_DISPATCH_KAFKA_TOPIC"]["value"] == "turns"
    assert env["AGENT_DISPATCH_KAFKA_GROUP"]["value"] == "agent-dispatch"
    assert env["AGENT_DISPATCH_CONCURRENCY"]["value"] == "8"
    assert env["AGENT_DISPATCH_EXECUTOR"]["value"] == "noop"
    assert env["AGENT_DISPATCH_METRICS_PORT"]["value"] == "9464"
    assert env[k8s_names.INSTANCE_ENV]["value"] == "demo"
    assert env[k8s_names.NAMESPACE_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env[k8s_names.WORKER_ID_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_secrets_are_only_secret_key_refs() -> None:
    env = env_of(_desired.desired(body()).deployment)
    assert env["STATE_DB_URI"] == {
        "name": "STATE_DB_URI",
        "valueFrom": {"secretKeyRef": {"name": "pg", "key": "dsn"}},
    }
    assert env["KAFKA_BOOTSTRAP_SERVERS"]["valueFrom"] == {
        "secretKeyRef": {"name": "kafka", "key": "servers"}
    }
    assert env["AGENT_DISPATCH_SIGNING_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "signing", "key": "key"}
    }
    for name in ("STATE_DB_URI", "KAFKA_BOOTSTRAP_SERVERS", "AGENT_DISPATCH_SIGNING_KEY"):
        assert "value" not in env[name]


def test_inline_bootstrap_servers_and_http_executor() -> None:
    spec = kafka_spec(kafka={"bootstrapServers": "k1:9092,k2:9092"})
    spec["worker"]["executor"] = {"name": "http", "url": "http://agent.svc:8080/turn", "timeoutSeconds": 90}
    env = env_of(_desired.desired(body(spec)).deployment)
    assert env["KAFKA_BOOTSTRAP_SERVERS"]["value"] == "k1:9092,k2:9092"
    assert env["AGENT_DISPATCH_KAFKA_TOPIC"]["value"] == "agent_turns"
    assert env["AGENT_DISPATCH_EXECUTOR"]["value"] == "http"
    assert env["AGENT_DISPATCH_EXECUTOR_URL"]["value"] == "http://agent.svc:8080/turn"
    assert env["AGENT_DISPATCH_EXECUTOR_TIMEOUT_S"]["value"] == "90"


def test_user_env_is_appended_and_reserved_names_are_never_duplicated() -> None:
    spec = kafka_spec()
    spec["worker"]["env"] = [
        {"name": "EXTRA", "value": "1"},
        {"name": "STATE_DB_URI", "value": "postgresql://x"},
    ]
    container = _desired.desired(body(spec)).deployment["spec"]["template"]["spec"]["containers"][0]
    names = [e["name"] for e in container["env"]]
    assert names[-1] == "EXTRA"
    assert len(names) == len(set(names))
    assert {"name": "STATE_DB_URI", "value": "postgresql://x"} not in container["env"]


def test_children_are_owned_by_the_agentdispatch() -> None:
    rendered = _desired.desired(body())
    for obj in rendered.objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["name"] == "demo-worker"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": k8s_names.API_VERSION,
                "kind": k8s_names.KIND,
                "name": "demo",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][k8s_names.INSTANCE_LABEL] == "demo"
        assert meta["labels"]["team"] == "a"  # the owner's labels are inherited


def test_deployment_shape_and_pod_security() -> None:
    deployment = _desired.desired(body()).deployment
    assert deployment["spec"]["replicas"] == 2
    selector = deployment["spec"]["selector"]["matchLabels"]
    template = deployment["spec"]["template"]
    assert selector.items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    assert container["image"] == "example.invalid/agent-dispatch:1.2.3"
    assert container["command"] == ["agent-dispatch-worker"]
    sec = container["securityContext"]
    assert sec["readOnlyRootFilesystem"] is True
    assert sec["allowPrivilegeEscalation"] is False
    assert sec["capabilities"] == {"drop": ["ALL"]}
    assert sec["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["ports"] == [{"name": "metrics", "containerPort": 9464, "protocol": "TCP"}]
    assert container["resources"]["limits"]["memory"] == "512Mi"
    assert pod["terminationGracePeriodSeconds"] == 30 + _desired.KILL_MARGIN_S


def test_worker_service_account_defaults_to_the_releases_and_the_spec_wins() -> None:
    """The chart tells the operator its release's worker ServiceAccount; a spec naming one keeps it."""
    pod = _desired.desired(body(), None, "rel-worker").deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "rel-worker"
    spec = kafka_spec(worker={"image": "img:1", "serviceAccountName": "own"})
    pod = _desired.desired(body(spec), None, "rel-worker").deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "own"
    assert "serviceAccountName" not in _desired.desired(body()).deployment["spec"]["template"]["spec"]


def test_service_selects_the_worker_pods() -> None:
    rendered = _desired.desired(body())
    assert rendered.service["spec"]["selector"] == rendered.deployment["spec"]["selector"]["matchLabels"]
    assert rendered.service["spec"]["ports"][0]["port"] == 9464


def test_autoscaling_off_renders_no_autoscaler_and_removes_both() -> None:
    rendered = _desired.desired(body())
    assert rendered.autoscaler is None
    assert {kind for _, kind, _ in rendered.absent} == {"HorizontalPodAutoscaler", "ScaledObject"}


def test_hpa_mode_never_writes_replicas() -> None:
    spec = kafka_spec(
        autoscaling={"mode": "hpa", "minReplicas": 2, "maxReplicas": 6, "targetDepthPerReplica": 25}
    )
    rendered = _desired.desired(body(spec))
    assert "replicas" not in rendered.deployment["spec"]
    hpa = rendered.autoscaler
    assert hpa is not None
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "demo-worker",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    external = hpa["spec"]["metrics"][0]["external"]
    assert external["metric"]["name"] == "agent_dispatch_queue_depth"
    assert external["metric"]["selector"] == {"matchLabels": {k8s_names.INSTANCE_LABEL: "demo"}}
    assert external["target"] == {"type": "AverageValue", "averageValue": "25"}
    assert [kind for _, kind, _ in rendered.absent] == ["ScaledObject"]


def test_keda_kafka_trigger_reads_servers_from_the_worker_env() -> None:
    spec = kafka_spec(autoscaling={"mode": "keda", "minReplicas": 0, "maxReplicas": 6})
    rendered = _desired.desired(body(spec))
    assert "replicas" not in rendered.deployment["spec"]
    scaled = rendered.autoscaler
    assert scaled is not None and scaled["kind"] == "ScaledObject"
    assert scaled["spec"]["minReplicaCount"] == 0
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["bootstrapServersFromEnv"] == "KAFKA_BOOTSTRAP_SERVERS"
    assert trigger["metadata"]["topic"] == "turns"
    assert trigger["metadata"]["lagThreshold"] == "10"
    assert [kind for _, kind, _ in rendered.absent] == ["HorizontalPodAutoscaler"]


def test_keda_postgres_trigger_uses_the_connection_from_env() -> None:
    spec = postgres_spec(autoscaling={"mode": "keda", "maxReplicas": 4})
    trigger = _desired.scaled_object("demo", _spec.parse(spec), depth_query="SELECT 7")["spec"]["triggers"][0]
    assert trigger["type"] == "postgresql"
    assert trigger["metadata"]["connectionFromEnv"] == "STATE_DB_URI"
    assert trigger["metadata"]["query"] == "SELECT 7"
    spec["autoscaling"]["postgresqlQuery"] = "SELECT 8"
    trigger = _desired.scaled_object("demo", _spec.parse(spec))["spec"]["triggers"][0]
    assert trigger["metadata"]["query"] == "SELECT 8"


def test_rendering_is_deterministic_and_pure() -> None:
    source = body()
    before = copy.deepcopy(source)
    assert _desired.desired(source).objects == _desired.desired(source).objects
    assert source == before


# --- validation -----------------------------------------------------------------------------------


def test_valid_specs_have_no_problems() -> None:
    assert _validate.validate(kafka_spec(), "demo") == []
    assert _validate.validate(postgres_spec(), "demo") == []
    assert _validate.validate({"backend": "sqlite", "worker": {"image": "x"}}, "demo") == []


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("ttl above the RTO", kafka_spec(claimTtlSeconds=301), "spec.claimTtlSeconds"),
    (
        "renew equal to ttl",
        kafka_spec(claimTtlSeconds=30, renewIntervalSeconds=30),
        "spec.renewIntervalSeconds",
    ),
    ("zero depth", kafka_spec(maxDepth=0), "spec.maxDepth"),
    ("negative depth", kafka_spec(maxDepth=-5), "spec.maxDepth"),
    ("postgres without dsn", {"backend": "postgres", "worker": {"image": "x"}}, "spec.postgres.dsnSecretRef"),
    ("kafka without servers", kafka_spec(kafka={"topic": "t"}), "spec.kafka.bootstrapServers"),
    ("postgres without a signing key", postgres_spec(signingKeySecretRef=None), "spec.signingKeySecretRef"),
    (
        "kafka with both",
        kafka_spec(
            kafka={"bootstrapServers": "k:9092", "bootstrapServersSecretRef": {"name": "k", "key": "s"}}
        ),
        "spec.kafka.bootstrapServersSecretRef",
    ),
    (
        "max below min",
        kafka_spec(autoscaling={"mode": "hpa", "minReplicas": 4, "maxReplicas": 2}),
        "spec.autoscaling.maxReplicas",
    ),
    (
        "kafka max above partitions",
        kafka_spec(autoscaling={"mode": "keda", "maxReplicas": 7}),
        "spec.autoscaling.maxReplicas",
    ),
    (
        "hpa min zero",
        kafka_spec(autoscaling={"mode": "hpa", "minReplicas": 0, "maxReplicas": 3}),
        "spec.autoscaling.minReplicas",
    ),
    ("sqlite scaled out", {"backend": "sqlite", "worker": {"image": "x", "replicas": 3}}, "spec.backend"),
    ("no image", kafka_spec(worker={}), "spec.worker.image"),
    (
        "reserved env",
        kafka_spec(worker={"image": "x", "env": [{"name": "STATE_DB_URI", "value": "p"}]}),
        "spec.worker.env",
    ),
    (
        "http without url",
        kafka_spec(worker={"image": "x", "executor": {"name": "http"}}),
        "spec.worker.executor.url",
    ),
    ("bad backend", kafka_spec(backend="redis"), "spec.backend"),
    (
        "bad secret name",
        postgres_spec(postgres={"dsnSecretRef": {"name": "Bad_Name", "key": "k"}}),
        "spec.postgres.dsnSecretRef.name",
    ),
    ("string ttl", kafka_spec(claimTtlSeconds="60"), "spec.claimTtlSeconds"),
]


@pytest.mark.parametrize(("label", "spec", "field"), INVALID, ids=[case[0] for case in INVALID])
def test_invalid_specs_name_the_field(label: str, spec: dict[str, Any], field: str) -> None:
    problems = _validate.validate(spec, "demo")
    assert field in [p.field for p in problems], (label, problems)


def test_name_too_long_for_the_worker_service() -> None:
    problems = _validate.validate(kafka_spec(), "a" * 57)
    assert [p.field for p in problems] == ["metadata.name"]


def test_partition_decrease_is_a_problem_only_below_the_mark() -> None:
    assert _validate.partition_decrease(6, None) is None
    assert _validate.partition_decrease(6, 6) is None
    assert _validate.partition_decrease(8, 6) is None
    problem = _validate.partition_decrease(3, 6)
    assert problem is not None and problem.field == "spec.partitions" and "nothing changed" in problem.message


# --- status ---------------------------------------------------------------------------------------

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def lease(holder: str, renewed: dt.datetime | None, duration: int = 30) -> dict[str, Any]:
    spec: dict[str, Any] = {"holderIdentity": holder, "leaseDurationSeconds": duration}
    if renewed is not None:
        spec["renewTime"] = renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"metadata": {"name": f"demo-worker-{holder}"}, "spec": spec}


def test_fold_leases_into_live_and_stale() -> None:
    leases = [
        lease("w1", NOW - dt.timedelta(seconds=5)),
        lease("w2", NOW - dt.timedelta(seconds=31)),
        lease("w3", NOW - dt.timedelta(seconds=30)),  # exactly at expiry: still live
        lease("w4", None),
        {
            "metadata": {"name": "orphan"},
            "spec": {"acquireTime": NOW.isoformat(), "leaseDurationSeconds": 10},
        },
    ]
    workers = _status.fold_leases(leases, NOW)
    assert workers.live_ids == ("orphan", "w1", "w3")
    assert workers.stale_ids == ("w2", "w4")
    assert (workers.live, workers.stale) == (3, 2)


def test_conditions_ready_when_everything_is_fine() -> None:
    obs = _status.Observation(transport_ok=True, workers=_status.Workers(("w1",)), desired_workers=1)
    conds = {c.type: c for c in _status.conditions(obs)}
    assert set(conds) == set(_status.CONDITION_TYPES)
    assert conds["Ready"].status == "True"
    assert conds["ConfigValid"].status == "True"
    assert conds["TransportReachable"].status == "True"
    assert conds["WorkersAvailable"].status == "True"


def test_conditions_for_a_refused_partition_decrease() -> None:
    obs = _status.Observation(
        refused_reason="PartitionDecreaseRefused",
        refused_message="spec.partitions: cannot decrease",
        transport_ok=True,
    )
    ready = _status.conditions(obs)[0]
    assert (ready.type, ready.status, ready.reason) == ("Ready", "False", "PartitionDecreaseRefused")


def test_conditions_for_an_invalid_spec() -> None:
    obs = _status.Observation(problems=("spec.maxDepth: must be at least 1",))
    conds = {c.type: c for c in _status.conditions(obs)}
    assert (conds["ConfigValid"].status, conds["ConfigValid"].reason) == ("False", "InvalidSpec")
    assert "spec.maxDepth" in conds["ConfigValid"].message
    assert conds["Ready"].status == "False"


def test_merge_conditions_keeps_transition_time_while_status_holds() -> None:
    first = _status.merge_conditions(None, [_status.Condition("Ready", "False", "X")], 1, NOW)
    later = NOW + dt.timedelta(minutes=5)
    same = _status.merge_conditions(first, [_status.Condition("Ready", "False", "Y")], 2, later)
    assert same[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
    assert same[0]["observedGeneration"] == 2
    flipped = _status.merge_conditions(same, [_status.Condition("Ready", "True", "Z")], 2, later)
    assert flipped[0]["lastTransitionTime"] == _status.rfc3339(later)


def test_doctor_report_has_lease_recovery_and_no_secrets() -> None:
    report = _status.doctor_report(_spec.parse(kafka_spec()))
    names = [c["name"] for c in report["checks"]]
    assert "dispatch_lease_recovery" in names
    recovery = next(c for c in report["checks"] if c["name"] == "dispatch_lease_recovery")
    assert recovery["status"] == "ok"
    assert recovery["data"]["claim_ttl_s"] == 60
    signing = next(c for c in report["checks"] if c["name"] == "signing_key")
    assert signing["status"] == "ok"
    assert report["overall"] in {"ok", "warn"}
    assert "configured" not in json.dumps(report)  # markers never leak as values


def test_doctor_report_never_reads_the_operators_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_DISPATCH_CLAIM_TTL_S", "7")
    monkeypatch.setenv("STATE_DB_URI", "postgresql://user:pw@db.internal/x")
    report = _status.doctor_report(_spec.parse(postgres_spec()))
    text = json.dumps(report)
    assert "db.internal" not in text and "pw" not in text
    recovery = next(c for c in report["checks"] if c["name"] == "dispatch_lease_recovery")
    assert recovery["data"]["claim_ttl_s"] == 120


def test_secret_value_decodes_data() -> None:
    assert secret_value({"data": {"k": "aGVsbG8="}}, "k") == "hello"
    assert secret_value({"stringData": {"k": "plain"}}, "k") == "plain"
    assert secret_value({"data": {}}, "k") is None
    assert secret_value(None, "k") is None


# --- one reconcile pass against fakes -------------------------------------------------------------


class FakeCluster:
    """In-memory Cluster: an apply that changes nothing keeps the resourceVersion, like SSA."""

    def __init__(self, secrets: dict[tuple[str, str], str] | None = None, serves_keda: bool = True) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.secrets = secrets or {}
        self.serves_keda = serves_keda
        self.version = 0
        self.writes = 0
        self.leases: list[dict[str, Any]] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(found) if found else None

    def apply(self, obj: Any) -> dict[str, Any]:
        if obj["kind"] == "ScaledObject" and not self.serves_keda:
            raise ClusterError(404, "the server could not find the requested resource")
        key = (obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        old = self.objects.get(key)
        content = copy.deepcopy(dict(obj))
        if old is not None:
            stripped = copy.deepcopy(old)
            stripped["metadata"].pop("resourceVersion")
            if stripped == content:
                return copy.deepcopy(old)
        self.version += 1
        self.writes += 1
        content["metadata"]["resourceVersion"] = str(self.version)
        self.objects[key] = content
        return copy.deepcopy(content)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        return self.objects.pop((api_version, kind, namespace, name), None) is not None

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return copy.deepcopy(self.leases)

    def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        return self.secrets.get((name, key))


class FakeKafka:
    def __init__(self, partitions: int | None = None) -> None:
        self.partitions = partitions
        self.calls: list[tuple[str, int]] = []

    def ensure(self, servers: str, topic: str, partitions: int, rf: int | None) -> _kafka.TopicResult:
        if self.partitions is None:
            self.partitions = partitions
            self.calls.append(("create", partitions))
            return _kafka.TopicResult("created", partitions, "created")
        if partitions < self.partitions:
            return _kafka.TopicResult("refused", self.partitions, "would decrease; nothing changed")
        if partitions == self.partitions:
            return _kafka.TopicResult("unchanged", partitions, "unchanged")
        self.calls.append(("grow", partitions))
        self.partitions = partitions
        return _kafka.TopicResult("grown", partitions, "grown")

    def ops(self) -> _reconcile.KafkaOps:
        return _reconcile.KafkaOps(
            ensure_topic=self.ensure,
            describe_topic=lambda servers, topic: self.partitions,
            consumer_lag=lambda servers, topic, group: 4,
        )


def kafka_cluster() -> FakeCluster:
    return FakeCluster({("kafka", "servers"): "127.0.0.1:9092"})


def kafka_only_spec(**overrides: Any) -> dict[str, Any]:
    spec = kafka_spec(**overrides)
    del spec["postgres"]
    return spec


def test_reconcile_creates_then_is_idempotent() -> None:
    cluster, kafka = kafka_cluster(), FakeKafka()
    first = _reconcile.reconcile(body(kafka_only_spec()), cluster, kafka.ops())
    assert {(c.kind, c.action) for c in first.changes} == {("Deployment", "created"), ("Service", "created")}
    assert [e.reason for e in first.events] == ["TopicCreated", "Created", "Created"]
    assert first.status["partitions"] == 6
    assert first.status["queueDepth"] == 4
    assert first.status["observedGeneration"] == 3
    writes = cluster.writes
    second = _reconcile.reconcile(body(kafka_only_spec(), status=first.status), cluster, kafka.ops())
    assert second.changes == [] and second.events == []
    assert cluster.writes == writes
    assert kafka.calls == [("create", 6)]


def test_reconcile_grows_partitions_and_rolls_the_deployment() -> None:
    cluster, kafka = kafka_cluster(), FakeKafka()
    first = _reconcile.reconcile(body(kafka_only_spec()), cluster, kafka.ops())
    grown = _reconcile.reconcile(
        body(kafka_only_spec(partitions=12), status=first.status), cluster, kafka.ops()
    )
    assert kafka.partitions == 12
    assert "PartitionsGrown" in [e.reason for e in grown.events]
    assert [(c.kind, c.action) for c in grown.changes] == [("Deployment", "updated")]
    assert grown.status["partitions"] == 12


def test_reconcile_refuses_a_partition_decrease_and_changes_nothing() -> None:
    cluster, kafka = kafka_cluster(), FakeKafka(partitions=6)
    # No recorded status (e.g. the object was recreated): the topic itself is the authority.
    outcome = _reconcile.reconcile(body(kafka_only_spec(partitions=3)), cluster, kafka.ops())
    assert cluster.writes == 0 and kafka.calls == []
    assert outcome.changes == []
    ready = outcome.status["conditions"][0]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "PartitionDecreaseRefused")
    assert [e.reason for e in outcome.events] == ["PartitionDecreaseRefused"]
    assert outcome.status["partitions"] == 6


def test_reconcile_refuses_below_the_recorded_mark_without_touching_the_topic() -> None:
    cluster, kafka = kafka_cluster(), FakeKafka(partitions=6)
    outcome = _reconcile.reconcile(
        body(kafka_only_spec(partitions=3), status={"partitions": 6}), cluster, kafka.ops()
    )
    assert cluster.writes == 0 and kafka.calls == []
    assert outcome.observation.refused_reason == "PartitionDecreaseRefused"


def test_reconcile_invalid_spec_sets_config_valid_false_and_changes_nothing() -> None:
    cluster, kafka = kafka_cluster(), FakeKafka()
    outcome = _reconcile.reconcile(body(kafka_only_spec(claimTtlSeconds=400)), cluster, kafka.ops())
    assert cluster.writes == 0 and kafka.calls == []
    conds = {c["type"]: c for c in outcome.status["conditions"]}
    assert (conds["ConfigValid"]["status"], conds["ConfigValid"]["reason"]) == ("False", "InvalidSpec")
    assert "spec.claimTtlSeconds" in conds["ConfigValid"]["message"]
    assert outcome.events[0].type == "Warning"


def test_reconcile_without_keda_reports_the_autoscaler() -> None:
    cluster = FakeCluster({("kafka", "servers"): "127.0.0.1:9092"}, serves_keda=False)
    spec = kafka_only_spec(autoscaling={"mode": "keda", "maxReplicas": 6})
    outcome = _reconcile.reconcile(body(spec), cluster, FakeKafka().ops())
    assert outcome.observation.autoscaler_error is not None
    ready = outcome.status["conditions"][0]
    assert ready["reason"] == "AutoscalerUnavailable"
    deployment = cluster.get("apps/v1", "Deployment", "team-a", "demo-worker")
    assert deployment is not None and "replicas" not in deployment["spec"]


def test_refresh_counts_workers_and_writes_nothing() -> None:
    cluster, kafka = kafka_cluster(), FakeKafka()
    first = _reconcile.reconcile(body(kafka_only_spec()), cluster, kafka.ops())
    now = _status.now_utc()
    cluster.leases = [lease("w1", now), lease("w2", now - dt.timedelta(seconds=120))]
    writes = cluster.writes
    refreshed = _reconcile.refresh(body(kafka_only_spec(), status=first.status), cluster, kafka.ops())
    assert cluster.writes == writes
    assert refreshed.status["workers"]["live"] == 1
    assert refreshed.status["workers"]["stale"] == 1
    assert refreshed.status["workers"]["liveIds"] == ["w1"]
    assert refreshed.status["lastReconcileTime"] == first.status["lastReconcileTime"]
    conds = {c["type"]: c["status"] for c in refreshed.status["conditions"]}
    assert conds["WorkersAvailable"] == "True"


def test_cleanup_deletes_the_children() -> None:
    cluster, kafka = kafka_cluster(), FakeKafka()
    _reconcile.reconcile(body(kafka_only_spec()), cluster, kafka.ops())
    changes = _reconcile.cleanup(body(kafka_only_spec()), cluster)
    assert {c.kind for c in changes} == {"Deployment", "Service"}
    assert cluster.objects == {}


# --- the entry point ------------------------------------------------------------------------------


def test_operator_scope_defaults_to_all_namespaces() -> None:
    from agent_dispatch.operator._run import scope_of

    assert scope_of([], False) == (True, [])
    assert scope_of(["team-a", "team-b"], False) == (False, ["team-a", "team-b"])
    assert scope_of([], True) == (True, [])


def test_operator_exits_2_on_an_invalid_setting() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "AGENT_DISPATCH_CLAIM_TTL_S": "999"}
    proc = subprocess.run(
        [sys.executable, "-m", "agent_dispatch.cli", "operator", "-n", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "AGENT_DISPATCH_CLAIM_TTL_S" in proc.stderr
