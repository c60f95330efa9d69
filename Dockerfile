# One image for every rpcps role; the command picks it: `ps`, `trainer`, `agent`, `observer`.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RPCPS_SIDECAR_HOST=0.0.0.0 \
    RPCPS_SIDECAR_PORT=8080 \
    RPCPS_CHECKPOINT_DIR=/checkpoints

WORKDIR /app

# Dependencies first, in their own layer: a code change does not reinstall torch. CPU torch is
# pinned from PyTorch's CPU index (an unpinned torch pulls gigabytes of CUDA wheels).
COPY pyproject.toml README.md ./
RUN mkdir -p services ps trainer \
    && touch services/__init__.py ps/__init__.py trainer/__init__.py \
    && pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu . \
    && pip uninstall --yes rpcps

COPY services ./services
COPY ps ./ps
COPY trainer ./trainer
RUN pip install --no-cache-dir --no-deps . \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin rpcps \
    && mkdir -p /checkpoints \
    && chown 10001:10001 /checkpoints

USER 10001
VOLUME ["/checkpoints"]
# 8080: the sidecar (health, metrics, control). 29500: the rendezvous store, on ps0 or the agent.
EXPOSE 8080 29500

HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"]

ENTRYPOINT ["rpcps"]
CMD ["--help"]
