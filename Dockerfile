# rollout-dispatcher image.
#
#   scripts/build-image.sh             (buildah; or: docker build -t rollout-dispatcher .)
#   docker run --rm -p 9464:9464 -v "$PWD/run:/data" rollout-dispatcher \
#       run --config /data/config.toml --metrics-listen 0.0.0.0:9464
#   docker run --rm -v "$PWD/run:/data" rollout-dispatcher init /data/examples
#
# The examples (config, Prometheus rules, Grafana dashboard, Slurm/systemd/
# Kubernetes files) are package data: `dispatcher init DIR` writes them.
#
# The daemon must listen on 0.0.0.0 (not the loopback default) for the
# published port and for Prometheus to reach it: pass
# `--metrics-listen 0.0.0.0:9464` (set below as DISPATCHER_METRICS_LISTEN).
# HEALTHCHECK is a Docker-format feature: build with `--format docker` under
# buildah/podman, which ignore it in OCI images.

ARG BASE_IMAGE=python:3.11-slim

# --- builder: the wheel and a virtualenv with its dependencies ---------------
FROM ${BASE_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
COPY pyproject.toml README.md LICENSE MANIFEST.in ./
COPY dispatcher ./dispatcher

# Only wheels: the dependencies ship binary wheels for this platform, so no
# compiler is needed here either.
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip wheel --no-deps --wheel-dir /wheels . \
    && /opt/venv/bin/pip install --only-binary=:all: /wheels/*.whl

# --- final: python, tini, the virtualenv; no build tools ---------------------
FROM ${BASE_IMAGE}

LABEL org.opencontainers.image.title="rollout-dispatcher" \
      org.opencontainers.image.description="Asyncio daemon that runs the rollout side of LLM RL jobs" \
      org.opencontainers.image.licenses="Apache-2.0"

# tini as PID 1: forwards SIGTERM/SIGINT to the dispatcher (graceful drain,
# exit 75) and reaps zombies. `apt-get clean` drops apt's ~75 MB package
# caches: official Debian-based images do that through an apt hook, bases
# built with debootstrap do not.
RUN apt-get update \
    && apt-get install -y --no-install-recommends "tini=0.19.*" \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 dispatcher \
    && useradd --system --uid 10001 --gid dispatcher --home-dir /data \
        --shell /usr/sbin/nologin dispatcher \
    && mkdir -p /data \
    && chown dispatcher:dispatcher /data

COPY --from=builder /opt/venv /opt/venv

ENV PATH="/opt/venv/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DISPATCHER_METRICS_LISTEN=0.0.0.0:9464

# Numeric, so Kubernetes runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /data
VOLUME ["/data"]

EXPOSE 9464

# No curl in the image: python asks /healthz; any error or non-2xx fails the check.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=4)"]

ENTRYPOINT ["tini", "--", "dispatcher"]
CMD ["--help"]
