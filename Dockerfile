# One image for every agent-dispatch process: the command picks which one runs.
#   agent-dispatch-operator          the Kubernetes operator (the Helm chart runs this)
#   agent-dispatch-worker            a worker (the operator's worker Deployments run this)
#   agent-dispatch gateway           the HTTP gateway
#   agent-dispatch --help            everything else (the default)
#
# Build:  docker build -t agent-dispatch:0.1.0 .
# The base image is pinned by version and referenced by name only, so it comes from whatever
# registry (or mirror) your container engine is configured with. BASE_IMAGE swaps it for any
# image with python3 and venv (the tests use a Debian bookworm image made by mmdebstrap), and
# WHEELHOUSE names a directory of the build context holding every dependency as a wheel, for a
# build with no network at all (docker build --network=none; see testenv/image.py).
# No "syntax" directive: the classic builder and BuildKit both build it without fetching a frontend.

ARG PYTHON_VERSION=3.11.13
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-bookworm

# ---- builder: build the wheel and install it with its dependencies into a virtualenv ----------
FROM ${BASE_IMAGE} AS builder

ARG WHEELHOUSE=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent_dispatch ./agent_dispatch
COPY docker/install.sh ./docker/
COPY docker/wheelhouse/ ./docker/wheelhouse/
# The same script tests/deploy/test_dockerfile.py runs into a clean virtualenv (WHEELHOUSE, a
# build argument, reaches it as an environment variable).
RUN sh docker/install.sh /src /opt/agent-dispatch

# ---- runtime: the virtualenv on the same slim base, no compiler, no pip, non-root ---------------
FROM ${BASE_IMAGE} AS runtime

ARG BASE_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown

LABEL org.opencontainers.image.title="agent-dispatch" \
      org.opencontainers.image.description="Queue-driven dispatcher for AI-agent turns: fenced leases, fair queues, and a Kubernetes operator." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="agent-dispatch" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

# The base image's own pip, setuptools and wheel go too (when it has them: Debian's python3
# has none): nothing in the image can build or install packages. The numeric user matches
# runAsUser in the chart and the operator's pods.
RUN if python -m pip --version >/dev/null 2>&1; then python -m pip uninstall --yes --quiet pip setuptools wheel; fi \
    && groupadd --system --gid 10001 agent-dispatch \
    && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin agent-dispatch \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/agent-dispatch

COPY --from=builder /opt/agent-dispatch /opt/agent-dispatch

ENV PATH=/opt/agent-dispatch/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    AGENT_DISPATCH_DATA_DIR=/var/lib/agent-dispatch

WORKDIR /var/lib/agent-dispatch
USER 10001:10001
EXPOSE 8000 8080 9464

ENTRYPOINT []
CMD ["agent-dispatch", "--help"]
