"""Pure functions: an AgentDispatch -> the objects the cluster should hold.

Nothing here talks to a cluster, so every rendering rule is unit-tested without one. The
handlers server-side apply what these functions return, so a field the operator does not
render (the replicas an autoscaler owns) is never written by it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import kopf

from agent_dispatch import k8s_names
from agent_dispatch.operator._spec import RESERVED_ENV, DispatchSpec, parse

WORKER_CONTAINER: Final = "worker"
WORKER_COMMAND: Final = ("agent-dispatch-worker",)
#: Kubernetes kills a pod this long after SIGTERM beyond the worker's own shutdown grace, so
#: the worker always gets to release the leases of turns it could not finish.
KILL_MARGIN_S: Final = 15
DATA_DIR: Final = "/var/lib/agent-dispatch"
#: Image USER of the project's Dockerfile; pinned here so a pod runs non-root even if an image
#: forgets its USER line (runAsNonRoot alone would then refuse to start rather than fix it).
RUN_AS_UID: Final = 10001
HPA_API_VERSION: Final = "autoscaling/v2"
KEDA_API_VERSION: Final = "keda.sh/v1alpha1"
#: KEDA postgresql trigger query when neither the spec nor the store supplies one. The table is
#: the queue table the design names; the store issue may export a cheaper DEPTH_QUERY.
#: The queue's admission counter: O(1), the same number admission compares against the bound.
DEFAULT_DEPTH_QUERY: Final = "SELECT depth FROM agent_dispatch_queue_depth"


def worker_name(instance: str) -> str:
    """Name of the worker Deployment, Service and autoscaler of AgentDispatch ``instance``."""
    return f"{instance}-worker"


def selector_labels(instance: str) -> dict[str, str]:
    """Labels that select one AgentDispatch's worker pods (stable: a Deployment selector is immutable)."""
    return {
        k8s_names.NAME_LABEL: k8s_names.APP_NAME,
        k8s_names.INSTANCE_APP_LABEL: instance,
        k8s_names.INSTANCE_LABEL: instance,
        k8s_names.COMPONENT_LABEL: k8s_names.WORKER_COMPONENT,
    }


def object_labels(instance: str) -> dict[str, str]:
    return {**selector_labels(instance), k8s_names.MANAGED_BY_LABEL: k8s_names.OPERATOR_NAME}


def _env_value(name: str, value: object) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def worker_env(instance: str, spec: DispatchSpec) -> list[dict[str, Any]]:
    """The worker container's environment: the settings module's variable names, from the spec.

    Connection strings and keys are only ever ``secretKeyRef``s, so no secret passes through the
    operator or lands in the Deployment.
    """
    env = [
        _env_value("TASK_QUEUE_BACKEND", spec.backend),
        _env_value("AGENT_TURNS_PARTITIONS", spec.partitions),
        _env_value("AGENT_DISPATCH_MAX_DEPTH", spec.max_depth),
        _env_value("AGENT_DISPATCH_CLAIM_TTL_S", spec.claim_ttl_s),
        _env_value("AGENT_DISPATCH_RENEW_INTERVAL_S", spec.renew_interval_s),
    ]
    if spec.sweep_interval_s is not None:
        env.append(_env_value("AGENT_DISPATCH_SWEEP_INTERVAL_S", spec.sweep_interval_s))
    if spec.max_attempts is not None:
        env.append(_env_value("AGENT_DISPATCH_MAX_ATTEMPTS", spec.max_attempts))
    if spec.dsn_secret is not None:
        env.append({"name": "STATE_DB_URI", "valueFrom": spec.dsn_secret.as_env_source()})
    if spec.kafka is not None and spec.backend == "kafka":
        if spec.kafka.bootstrap_servers_secret is not None:
            env.append(
                {
                    "name": "KAFKA_BOOTSTRAP_SERVERS",
                    "valueFrom": spec.kafka.bootstrap_servers_secret.as_env_source(),
                }
            )
        elif spec.kafka.bootstrap_servers is not None:
            env.append(_env_value("KAFKA_BOOTSTRAP_SERVERS", spec.kafka.bootstrap_servers))
        env.append(_env_value("AGENT_DISPATCH_KAFKA_TOPIC", spec.kafka.topic))
        env.append(_env_value("AGENT_DISPATCH_KAFKA_GROUP", spec.kafka.consumer_group))
    if spec.signing_key_secret is not None:
        env.append(
            {"name": "AGENT_DISPATCH_SIGNING_KEY", "valueFrom": spec.signing_key_secret.as_env_source()}
        )
    executor = spec.worker.executor
    env += [
        _env_value("AGENT_DISPATCH_CONCURRENCY", spec.worker.concurrency),
        _env_value("AGENT_DISPATCH_EXECUTOR", executor.name),
    ]
    if executor.url is not None:
        env.append(_env_value("AGENT_DISPATCH_EXECUTOR_URL", executor.url))
    if executor.timeout_s is not None:
        env.append(_env_value("AGENT_DISPATCH_EXECUTOR_TIMEOUT_S", executor.timeout_s))
    env += [
        _env_value("AGENT_DISPATCH_SHUTDOWN_GRACE_S", spec.worker.shutdown_grace_s),
        _env_value("AGENT_DISPATCH_METRICS_PORT", spec.worker.metrics_port),
        _env_value("AGENT_DISPATCH_LOG_LEVEL", spec.worker.log_level),
        _env_value("AGENT_DISPATCH_LOG_FORMAT", "json"),
        _env_value("AGENT_DISPATCH_DATA_DIR", DATA_DIR),
        # The Lease contract: the worker labels its Lease with the instance and names it by pod.
        _env_value(k8s_names.INSTANCE_ENV, instance),
        {"name": k8s_names.NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": k8s_names.WORKER_ID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": k8s_names.POD_UID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    ]
    # Validation refuses reserved names; skipping them here too keeps an apply from ever
    # carrying two entries for one name (server-side apply rejects duplicate list-map keys).
    env += [copy.deepcopy(e) for e in spec.worker.env if e.get("name") not in RESERVED_ENV]
    return env


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_UID,
        "runAsGroup": RUN_AS_UID,
        "fsGroup": RUN_AS_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def deployment(
    instance: str, spec: DispatchSpec, default_service_account: str | None = None
) -> dict[str, Any]:
    """The worker Deployment. With autoscaling on, ``spec.replicas`` is left out entirely so the
    server-side apply never takes it back from the HPA or KEDA. ``default_service_account`` (the
    worker ServiceAccount the chart made for this release) applies when the spec names none."""
    worker = spec.worker
    name = worker_name(instance)
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": worker.image,
        "imagePullPolicy": worker.image_pull_policy,
        "command": list(WORKER_COMMAND),
        "env": worker_env(instance, spec),
        "ports": [
            {"name": k8s_names.METRICS_PORT_NAME, "containerPort": worker.metrics_port, "protocol": "TCP"}
        ],
        "resources": copy.deepcopy(worker.resources),
        "securityContext": _container_security(),
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": k8s_names.METRICS_PORT_NAME},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": k8s_names.METRICS_PORT_NAME},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "volumeMounts": [
            {"name": "data", "mountPath": DATA_DIR},
            # A read-only root filesystem still needs a writable /tmp for Python and its libraries.
            {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 - an emptyDir, not the host's /tmp
        ],
    }
    pod_spec: dict[str, Any] = {
        "securityContext": _pod_security(),
        "terminationGracePeriodSeconds": worker.shutdown_grace_s + KILL_MARGIN_S,
        "containers": [container],
        "volumes": [{"name": "data", "emptyDir": {}}, {"name": "tmp", "emptyDir": {"medium": "Memory"}}],
    }
    service_account = worker.service_account_name or default_service_account
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    if worker.node_selector:
        pod_spec["nodeSelector"] = dict(worker.node_selector)
    if worker.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(worker.tolerations)
    if worker.affinity:
        pod_spec["affinity"] = copy.deepcopy(worker.affinity)
    if worker.priority_class_name:
        pod_spec["priorityClassName"] = worker.priority_class_name
    pod_labels = {**worker.pod_labels, **selector_labels(instance)}
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": object_labels(instance)},
        "spec": {
            "selector": {"matchLabels": selector_labels(instance)},
            "revisionHistoryLimit": 3,
            # Surge first: a consumer group rebalances once per new pod, and capacity never dips.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": dict(worker.pod_annotations)},
                "spec": pod_spec,
            },
        },
    }
    if not spec.autoscaling.enabled:
        body["spec"]["replicas"] = worker.replicas
    return body


def service(instance: str, spec: DispatchSpec) -> dict[str, Any]:
    """A ClusterIP Service over the workers' metrics port (Prometheus scrapes it, the HPA's
    metrics adapter reads the queue-depth gauge from it)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": worker_name(instance), "labels": object_labels(instance)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(instance),
            "ports": [
                {
                    "name": k8s_names.METRICS_PORT_NAME,
                    "port": spec.worker.metrics_port,
                    "targetPort": k8s_names.METRICS_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def hpa(instance: str, spec: DispatchSpec) -> dict[str, Any]:
    """HPA v2 on the external metric ``agent_dispatch_queue_depth`` of this instance."""
    auto = spec.autoscaling
    return {
        "apiVersion": HPA_API_VERSION,
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": worker_name(instance), "labels": object_labels(instance)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": worker_name(instance)},
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": k8s_names.QUEUE_DEPTH_METRIC,
                            "selector": {"matchLabels": {k8s_names.INSTANCE_LABEL: instance}},
                        },
                        "target": {
                            "type": "AverageValue",
                            "averageValue": str(auto.target_depth_per_replica),
                        },
                    },
                }
            ],
        },
    }


def scaled_object(instance: str, spec: DispatchSpec, depth_query: str | None = None) -> dict[str, Any]:
    """KEDA ScaledObject: Kafka consumer lag (kafka) or the PostgreSQL queue depth (otherwise).

    Connection details are taken by KEDA from the worker container's own environment
    (``...FromEnv``), i.e. from the same Secret references, so no secret is copied anywhere.
    """
    auto = spec.autoscaling
    target = str(auto.target_depth_per_replica)
    trigger: dict[str, Any]
    if spec.backend == "kafka" and spec.kafka is not None:
        metadata: dict[str, str] = {
            "topic": spec.kafka.topic,
            "consumerGroup": spec.kafka.consumer_group,
            "lagThreshold": target,
            "offsetResetPolicy": "earliest",
            # More consumers than partitions would idle; the CRD caps maxReplicas at partitions.
            "allowIdleConsumers": "false",
        }
        if spec.kafka.bootstrap_servers is not None:
            metadata["bootstrapServers"] = spec.kafka.bootstrap_servers
        else:
            metadata["bootstrapServersFromEnv"] = "KAFKA_BOOTSTRAP_SERVERS"
        trigger = {"type": "kafka", "metadata": metadata}
    else:
        trigger = {
            "type": "postgresql",
            "metadata": {
                "connectionFromEnv": "STATE_DB_URI",
                "query": auto.postgresql_query or depth_query or DEFAULT_DEPTH_QUERY,
                "targetQueryValue": target,
            },
        }
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": {"name": worker_name(instance), "labels": object_labels(instance)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": worker_name(instance)},
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "pollingInterval": auto.polling_interval_s,
            "cooldownPeriod": auto.cooldown_s,
            "triggers": [trigger],
        },
    }


@dataclass(frozen=True)
class Desired:
    """Everything one AgentDispatch renders. ``autoscaler`` is None with autoscaling off;
    ``absent`` lists (apiVersion, kind, name) of rendered kinds that must not exist (an HPA
    left over after switching to KEDA, and so on)."""

    deployment: dict[str, Any]
    service: dict[str, Any]
    autoscaler: dict[str, Any] | None
    absent: tuple[tuple[str, str, str], ...]

    @property
    def objects(self) -> list[dict[str, Any]]:
        return [self.deployment, self.service, *([self.autoscaler] if self.autoscaler else [])]


def desired(
    body: Mapping[str, Any], depth_query: str | None = None, default_service_account: str | None = None
) -> Desired:
    """Render an AgentDispatch ``body`` (apiVersion, kind, metadata with name, namespace and uid,
    spec) into its children, owned by it through a controller owner reference."""
    meta = body["metadata"]
    instance = str(meta["name"])
    spec = parse(body.get("spec") or {})
    name = worker_name(instance)
    hpa_ref = (HPA_API_VERSION, "HorizontalPodAutoscaler", name)
    keda_ref = (KEDA_API_VERSION, "ScaledObject", name)
    autoscaler: dict[str, Any] | None
    absent: tuple[tuple[str, str, str], ...]
    if spec.autoscaling.mode == "hpa":
        autoscaler, absent = hpa(instance, spec), (keda_ref,)
    elif spec.autoscaling.mode == "keda":
        autoscaler, absent = scaled_object(instance, spec, depth_query), (hpa_ref,)
    else:
        autoscaler, absent = None, (hpa_ref, keda_ref)
    result = Desired(
        deployment(instance, spec, default_service_account), service(instance, spec), autoscaler, absent
    )
    # kopf.adopt sets the controller owner reference (so deletion cascades), the namespace, and
    # copies the owner's labels without overriding ours; it is pure on plain dicts.
    kopf.adopt(result.objects, owner=kopf.Body(_owner_view(body)))
    return result


def _owner_view(body: Mapping[str, Any]) -> Any:
    """The fields of the owner that an owner reference and kopf.adopt read."""
    meta = body["metadata"]
    return {
        "apiVersion": body.get("apiVersion", k8s_names.API_VERSION),
        "kind": body.get("kind", k8s_names.KIND),
        "metadata": {
            "name": meta["name"],
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "labels": dict(meta.get("labels") or {}),
        },
    }
