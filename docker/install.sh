#!/bin/sh
# The image's install steps, in one place: the Dockerfile's builder stage runs this script, and
# tests/image/test_install.py runs the very same script into a clean virtual environment and
# starts every entry point. Usage: docker/install.sh SOURCE_DIR VENV_DIR
#   1. build the project's wheel from SOURCE_DIR (no dependencies, no editable install);
#   2. create VENV_DIR with `python -m venv` and install the wheel and its dependencies there
#      (binary wheels only: no compiler is needed, none is in the image);
#   3. remove pip, setuptools and wheel from VENV_DIR: the final image carries no build tools.
set -eu
src=${1:?usage: install.sh SOURCE_DIR VENV_DIR}
venv=${2:?usage: install.sh SOURCE_DIR VENV_DIR}
python=${PYTHON:-python3}
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT

"$python" -m pip wheel --no-deps --no-cache-dir --wheel-dir "$wheels" "$src"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --no-cache-dir --only-binary=:all: "$wheels"/agent_dispatch-*.whl
"$venv/bin/python" -m pip uninstall --yes --quiet pip setuptools wheel
# Byte-compile once at build time, so a read-only root filesystem never needs to write .pyc files.
"$venv/bin/python" -m compileall -q "$venv/lib" >/dev/null || true
