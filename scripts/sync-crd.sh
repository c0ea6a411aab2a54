#!/usr/bin/env bash
# Copies the single source of the AgentDispatch CRD (crds/agentdispatch.yaml) into the Helm
# chart's crds/ folder. tests/helm/test_chart_static.py fails while the two differ.
# `--check` only compares (exit 1 when they differ), for CI or a pre-commit hook.
set -euo pipefail
cd "$(dirname "$0")/.."
src=crds/agentdispatch.yaml
dst=charts/agent-dispatch/crds/agentdispatch.yaml
if [ "${1:-}" = "--check" ]; then
  if cmp -s "$src" "$dst"; then
    echo "chart CRD is in sync with $src"
    exit 0
  fi
  echo "chart CRD differs from $src: run scripts/sync-crd.sh" >&2
  exit 1
fi
mkdir -p "$(dirname "$dst")"
cp "$src" "$dst"
echo "copied $src -> $dst"
