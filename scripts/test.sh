#!/usr/bin/env bash
# The whole test suite: installs the project into .venv, builds or downloads PostgreSQL, Kafka,
# etcd, kube-apiserver and helm into ~/.cache/agent-dispatch (once; cached by version), runs the
# quality gates, then pytest, which starts each service on loopback as the tests need it.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m postgres`).
set -euo pipefail
cd "$(dirname "$0")/.."

started=$(date +%s)
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'

.venv/bin/python -m testenv install
echo "[test.sh] set-up took $(( $(date +%s) - started ))s"

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports

.venv/bin/python -m pytest "$@"
echo "[test.sh] total $(( $(date +%s) - started ))s"
