#!/usr/bin/env bash
# The whole test suite: installs the project into .venv, builds or downloads PostgreSQL, Kafka,
# etcd, kube-apiserver, kube-controller-manager, kubectl, helm, and a node's kubelet,
# kube-scheduler, kube-proxy, containerd, runc, CNI plugins and docker, then the project's image
# from its Dockerfile, into ~/.cache/agent-dispatch (once; cached by version or content), runs the
# quality gates, then pytest, which starts each service on loopback (the node in a network
# namespace of its own) as the tests need it, in two worker processes. Extra arguments go to
# pytest (`bash scripts/test.sh -m postgres`; `-n 0` for one process).
set -uo pipefail
cd "$(dirname "$0")/.."

started=$(date +%s)
set -e
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -m testenv install
echo "[test.sh] set-up took $(( $(date +%s) - started ))s"
set +e

failed=()
.venv/bin/ruff check . || failed+=("ruff check")
.venv/bin/ruff format --check . || failed+=("ruff format")
.venv/bin/mypy || failed+=("mypy")
.venv/bin/lint-imports || failed+=("import-linter")

# Two worker processes: much of the suite waits on pods, brokers and timeouts rather than the
# CPU, so two share this machine's two cores well (tests/_fixtures/groups.py keeps each heavy
# service's tests in one worker). `-n 0` after it runs everything in one process.
.venv/bin/python -m pytest -n 2 "$@" || failed+=("pytest")

echo "[test.sh] total $(( $(date +%s) - started ))s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "[test.sh] FAILED: ${failed[*]}"
  exit 1
fi
