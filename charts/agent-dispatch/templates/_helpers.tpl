{{/* Names, labels and shared fragments of the agent-dispatch chart. */}}

{{- define "agent-dispatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, or the release name alone when it already contains the chart name. */}}
{{- define "agent-dispatch.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "agent-dispatch.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "agent-dispatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agent-dispatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels on every object the chart renders (helm owns these objects, not the operator). */}}
{{- define "agent-dispatch.labels" -}}
helm.sh/chart: {{ include "agent-dispatch.chart" . }}
app.kubernetes.io/name: {{ include "agent-dispatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: agent-dispatch
{{- end -}}

{{- define "agent-dispatch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "agent-dispatch.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "agent-dispatch.workerServiceAccountName" -}}
{{- default (printf "%s-worker" (include "agent-dispatch.fullname" .) | trunc 63 | trimSuffix "-") .Values.workers.serviceAccount.name -}}
{{- end -}}

{{/* The image reference: repository:tag, or repository@digest when a digest is given. */}}
{{- define "agent-dispatch.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Namespaces the operator watches in namespaced mode (a list, de-duplicated). */}}
{{- define "agent-dispatch.watchNamespaces" -}}
{{- if .Values.rbac.watchNamespaces -}}
{{- uniq .Values.rbac.watchNamespaces | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{/* Namespaces that get the worker Role: the watched ones, or the release namespace alone in
cluster-wide mode (other namespaces bring their own worker ServiceAccount and Role). */}}
{{- define "agent-dispatch.workerNamespaces" -}}
{{- if .Values.rbac.clusterWide -}}
{{- list .Release.Namespace | toJson -}}
{{- else -}}
{{- include "agent-dispatch.watchNamespaces" . -}}
{{- end -}}
{{- end -}}

{{/* The operator's namespaced permissions: one list of rules for a Role in each watched
namespace, or for the ClusterRole in cluster-wide mode. Every verb here is used by
agent_dispatch/operator (see the chart README for the reason of each). */}}
{{- define "agent-dispatch.operatorRules" -}}
# The custom resource: kopf lists and watches it, and patches its finalizer, its progress
# annotations and (through the subresource) its status.
- apiGroups: ["agentdispatch.io"]
  resources: ["agentdispatches"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["agentdispatch.io"]
  resources: ["agentdispatches/status"]
  verbs: ["patch"]
# Children carry an owner reference with blockOwnerDeletion, which clusters running the
# OwnerReferencesPermissionEnforcement admission plugin allow only to who may update finalizers.
- apiGroups: ["agentdispatch.io"]
  resources: ["agentdispatches/finalizers"]
  verbs: ["update"]
# Rendered children: read, server-side apply (a PATCH; "create" when the object is new), delete.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "create", "patch", "delete"]
{{- if .Values.rbac.keda }}
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
# Worker heartbeats: read-only.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["list", "watch"]
# kopf posts core/v1 Events about each AgentDispatch (Created, Updated, TopicCreated, ...).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- with .Values.rbac.secretNames }}
# Only the Secrets named in values (RBAC cannot follow an AgentDispatch's references).
- apiGroups: [""]
  resources: ["secrets"]
  resourceNames: {{ toJson (uniq .) }}
  verbs: ["get"]
{{- end }}
{{- end -}}

{{/* Pod and container security contexts shared by the operator (workers get the same from the
operator). uid 10001 is the image's USER. */}}
{{- define "agent-dispatch.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "agent-dispatch.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "agent-dispatch.metricsApiSelectorLabels" -}}
app.kubernetes.io/name: {{ include "agent-dispatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: metrics-api
{{- end -}}
