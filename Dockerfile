# kvserve image: the README's install steps (a venv, torch pinned first, then the package).
#
# CPU (default):
#   docker build -t kvserve .
# NVIDIA GPU: a CUDA runtime base and a CUDA torch wheel, e.g.
#   docker build -t kvserve:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# (PyPI's Linux torch wheel already bundles CUDA libraries; TORCH_INDEX_URL
#  picks a specific CUDA, or https://download.pytorch.org/whl/cpu for a small CPU-only image.)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kvserve/bin:$PATH

# CUDA bases ship without Python (or without venv); python:* images have both.
RUN if ! python3 -m venv /opt/kvserve 2>/dev/null; then \
      rm -rf /opt/kvserve && apt-get update && \
      apt-get install -y --no-install-recommends python3 python3-venv && \
      rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/kvserve; \
    fi \
 && pip install --upgrade pip

# A C compiler: the native GEMM and the cpu attention backend's decode kernel are built at first
# start, for the CPU they run on (-march=native). Without one, kvserve serves with oneDNN and the
# torch attention backend (and warns).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Own layer: torch is by far the largest download and changes least often.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"

WORKDIR /src
COPY . .
RUN pip install . && rm -rf /src/build

RUN useradd --create-home --uid 10001 kvserve
USER kvserve
WORKDIR /home/kvserve

# 50051: model service / gateway (Inference API); 50061: KV-cache manager.
EXPOSE 50051 50061
# The whole stack on the built-in tiny model; give --model /models/NAME for a real checkpoint.
CMD ["kvserve", "up", "--model", "tiny", "--listen", "0.0.0.0:50051"]
