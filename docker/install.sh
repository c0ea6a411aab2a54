#!/bin/sh
# The image's install steps, in one place: the Dockerfile's builder stage runs this script, and
# tests/deploy/test_dockerfile.py runs the very same script into a clean virtual environment and
# starts every entry point. Usage: docker/install.sh SOURCE_DIR VENV_DIR
#   1. create VENV_DIR with `python -m venv` (its own pip: the base interpreter may have none);
#   2. build the project's wheel from SOURCE_DIR (no dependencies, no editable install) and install
#      it with its dependencies into VENV_DIR (binary wheels only: no compiler is needed, none is in
#      the image);
#   3. remove pip, setuptools and wheel from VENV_DIR: the final image carries no build tools.
# With WHEELHOUSE set to a directory of wheels, pip uses only that directory (no network at all).
set -eu
src=${1:?usage: install.sh SOURCE_DIR VENV_DIR}
venv=${2:?usage: install.sh SOURCE_DIR VENV_DIR}
python=${PYTHON:-python3}
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
if [ -n "${WHEELHOUSE:-}" ]; then
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"
fi

"$python" -m venv "$venv"
"$venv/bin/python" -m pip wheel --no-deps --no-cache-dir --wheel-dir "$wheels" "$src"
"$venv/bin/python" -m pip install --no-cache-dir --only-binary=:all: "$wheels"/agent_dispatch-*.whl
"$venv/bin/python" -m pip uninstall --yes --quiet pip setuptools wheel
# Byte-compile once at build time, so a read-only root filesystem never needs to write .pyc files.
"$venv/bin/python" -m compileall -q "$venv/lib" >/dev/null || true
