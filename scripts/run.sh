#!/usr/bin/env bash
# The local run: installs agent-dispatch into .venv and runs it on the embedded default
# (SQLite in the XDG data directory, no servers). Extra arguments go to `agent-dispatch up`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q -e .
echo "agent-dispatch is installed in .venv/bin (source .venv/bin/activate to put it on your PATH)"
exec .venv/bin/agent-dispatch up "$@"
