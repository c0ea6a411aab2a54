#!/usr/bin/env bash
# One command for a local Kubernetes run of agent-dispatch with kind (needs a container engine:
# docker or podman, and kind, kubectl and helm on PATH):
#   1. create the kind cluster of hack/kind/cluster.yaml (skipped when it exists);
#   2. build the image from the Dockerfile and load it into the cluster's nodes (never pushed);
#   3. install the Helm chart (helm upgrade --install) and wait for the operator;
#   4. apply the example AgentDispatch and show it.
# `scripts/kind-up.sh --down` deletes the cluster. Environment: CLUSTER (agent-dispatch),
# NAMESPACE (agent-dispatch), IMAGE (agent-dispatch:0.1.0, the
# chart's appVersion and the image examples/agentdispatch-sqlite.yaml names), ENGINE (docker; or podman).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-agent-dispatch}
NAMESPACE=${NAMESPACE:-agent-dispatch}
IMAGE=${IMAGE:-agent-dispatch:0.1.0}
ENGINE=${ENGINE:-docker}
RELEASE=agent-dispatch

need() { command -v "$1" >/dev/null 2>&1 || { echo "kind-up: $1 is not on PATH" >&2; exit 3; }; }

if [ "${1:-}" = "--down" ]; then
  need kind
  kind delete cluster --name "$CLUSTER"
  exit 0
fi

for tool in kind kubectl helm "$ENGINE"; do need "$tool"; done

if kind get clusters | grep -qx "$CLUSTER"; then
  echo "kind-up: cluster $CLUSTER exists"
else
  kind create cluster --name "$CLUSTER" --config hack/kind/cluster.yaml --wait 120s
fi
context="kind-$CLUSTER"

"$ENGINE" build -t "$IMAGE" .
if [ "$ENGINE" = docker ]; then
  kind load docker-image "$IMAGE" --name "$CLUSTER"
else
  archive=$(mktemp --suffix=.tar)
  trap 'rm -f "$archive"' EXIT
  "$ENGINE" save -o "$archive" "$IMAGE"
  kind load image-archive "$archive" --name "$CLUSTER"
fi

helm upgrade --install "$RELEASE" charts/agent-dispatch \
  --kube-context "$context" --namespace "$NAMESPACE" --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
  --wait --timeout 5m

# The image is on the nodes already (kind load), so IfNotPresent never pulls it.
sed "s|image: agent-dispatch:0.1.0|image: $IMAGE|" examples/agentdispatch-sqlite.yaml \
  | kubectl --context "$context" -n "$NAMESPACE" apply -f -
kubectl --context "$context" -n "$NAMESPACE" rollout status deployment/example-worker --timeout 180s
kubectl --context "$context" -n "$NAMESPACE" get agentdispatch -o wide
