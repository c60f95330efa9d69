# syntax=docker/dockerfile:1
# One image for every rpcps role; the command picks it: `ps`, `trainer`, `ctr`, `agent`, `observer`,
# `serve` (and the one-shot `export`, which writes a model folder into /models).
FROM python:3.11-slim

# Where torch comes from, and only torch: PyTorch's CPU index by default (no CUDA libraries; pass
# another index for another build). WHEELS names a folder of wheels in the build context to take
# packages from first (e.g. `--build-arg WHEELS=wheels` on a machine without the indexes).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELS=""

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RPCPS_SIDECAR_HOST=0.0.0.0 \
    RPCPS_SIDECAR_PORT=8080 \
    RPCPS_CHECKPOINT_DIR=/checkpoints

WORKDIR /app

# Dependencies first, in their own layer, from the pinned list alone (requirements.lock, made from
# pyproject.toml by `python -m tools.lock`): a change to the code, the docs or the README
# reinstalls nothing. Each step names its one index: torch from TORCH_INDEX, the rest from PyPI
# (torch, already installed, satisfies the list's pin).
COPY requirements.lock ./
RUN --mount=type=bind,target=/context \
    pip install --no-cache-dir --no-deps --index-url "$TORCH_INDEX" ${WHEELS:+--find-links "/context/$WHEELS"} \
        "$(grep '^torch==' requirements.lock)" \
    && pip install --no-cache-dir --index-url https://pypi.org/simple ${WHEELS:+--find-links "/context/$WHEELS"} \
        -r requirements.lock

COPY pyproject.toml README.md LICENSE ./
COPY services ./services
COPY ps ./ps
COPY trainer ./trainer
COPY rpcps ./rpcps
RUN pip install --no-cache-dir --no-deps . \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin rpcps \
    && mkdir -p /checkpoints /models \
    && chown 10001:10001 /checkpoints /models

USER 10001
VOLUME ["/checkpoints"]
# 8080: the sidecar (health, metrics, control). 29500: the rendezvous store, on ps0 or the agent.
EXPOSE 8080 29500

HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"]

ENTRYPOINT ["rpcps"]
CMD ["--help"]
