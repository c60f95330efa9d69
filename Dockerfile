# syntax=docker/dockerfile:1
# One image for every rpcps role; the command picks it: `ps`, `trainer`, `ctr`, `agent`, `observer`,
# `serve` (and the one-shot `export`, which writes a model folder into /models).
# BASE: any image with Python 3.11 or later and its venv module (a Debian bookworm made with
# mmdebstrap, say, where no registry can be reached: --build-arg BASE=localhost/bookworm).
ARG BASE=python:3.11-slim
FROM ${BASE}

# Where packages come from. TORCH_INDEX: torch alone, from PyTorch's CPU index by default (no CUDA
# libraries; pass another index for another build). PIP_INDEX: everything else. WHEELS names a
# folder of wheels in the build context to install from instead, without any index (a machine
# with no route to them: `pip download -d wheels -r requirements.lock 'setuptools>=77'`, then
# --build-arg WHEELS=wheels).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX=https://pypi.org/simple
ARG WHEELS=""

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/rpcps/bin:$PATH \
    RPCPS_SIDECAR_HOST=0.0.0.0 \
    RPCPS_SIDECAR_PORT=8080 \
    RPCPS_CHECKPOINT_DIR=/checkpoints

WORKDIR /app

# A virtualenv of its own: a distribution's Python refuses pip installs into its own packages,
# and `python`, `pip` and `rpcps` are then on PATH whatever the base calls them.
# Dependencies first, in their own layer, from the pinned list alone (requirements.lock, made from
# pyproject.toml by `python -m tools.lock`): a change to the code, the docs or the README
# reinstalls nothing. Each step names its one index: torch from TORCH_INDEX, the rest from
# PIP_INDEX (torch, already installed, satisfies the list's pin); or, with WHEELS, no index.
COPY requirements.lock ./
RUN --mount=type=bind,target=/context \
    python3 -m venv /opt/rpcps \
    && if [ -n "$WHEELS" ]; then \
        pip install --no-cache-dir --no-index --find-links "/context/$WHEELS" -r requirements.lock 'setuptools>=77'; \
    else \
        pip install --no-cache-dir --no-deps --index-url "$TORCH_INDEX" "$(grep '^torch==' requirements.lock)" \
        && pip install --no-cache-dir --index-url "$PIP_INDEX" -r requirements.lock 'setuptools>=77'; \
    fi

COPY pyproject.toml README.md LICENSE ./
COPY services ./services
COPY supervise ./supervise
COPY ps ./ps
COPY trainer ./trainer
COPY rpcps ./rpcps
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin rpcps \
    && mkdir -p /checkpoints /models \
    && chown 10001:10001 /checkpoints /models

USER 10001
# No VOLUME: only the servers (and the RL agent) write /checkpoints, into the volume their service
# mounts there. Declared here, it gave every other container an anonymous volume that
# `podman-compose down -v` leaves behind.
# 8080: the sidecar (health, metrics, control). 29500: the rendezvous store, on ps0 or the agent.
EXPOSE 8080 29500

HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"]

ENTRYPOINT ["rpcps"]
CMD ["--help"]
