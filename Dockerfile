# kvserve image: the README's install steps (a venv, torch pinned first, then the package), in
# two stages. The first has a C compiler and builds everything, the native CPU kernels included
# (setup.py, for every instruction-set level they list, not for the build machine's CPU); the
# serving image is the venv alone, with no compiler.
#
# CPU (default): torch's CPU-only wheel, from PyTorch's CPU index (PyPI's Linux wheel of torch
# brings several GB of CUDA libraries with it):
#   docker build -t kvserve .
# NVIDIA GPU: PyPI's wheel (it bundles CUDA 13's libraries; the host's driver is all the node
# needs) and flash-attn 4 with its CUDA 13 build (the fa4-cu13 extra: the pairing the GPU runs of
# docs/benchmarks.md used, there with torch 2.11.0+cu130; fa4 alone on CUDA 12), e.g.
#   docker build -t kvserve:cuda --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
#     --build-arg EXTRAS='fa4-cu13' .
# (EXTRAS=gpu is flash-attn 2, which builds from source: it needs a CUDA -devel BASE_IMAGE, with
#  nvcc.) Another CUDA: TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXXX.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kvserve/bin:$PATH
# gcc for the native kernels; CUDA bases ship without Python (or without venv).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && if ! python3 -m venv /opt/kvserve 2>/dev/null; then \
      rm -rf /opt/kvserve && apt-get install -y --no-install-recommends python3 python3-venv python3-dev && \
      python3 -m venv /opt/kvserve; \
    fi \
 && rm -rf /var/lib/apt/lists/* \
 && pip install --upgrade pip
# Own layer: torch is by far the largest download and changes least often.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
WORKDIR /src
# The dependencies in a layer of their own, from pyproject.toml alone: an edit to the source does
# not download them again.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt
COPY . .
RUN pip install ".${EXTRAS:+[$EXTRAS]}" \
 && python -c "from kvserve.model_service.kernels.library import missing_builds as m; \
assert not m(), f'native kernels not built: {m()}; pip install -v . shows why'"

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PATH=/opt/kvserve/bin:$PATH
# The venv's python is the base image's; CUDA bases need it installed here too.
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --gid 10001 kvserve && useradd --create-home --uid 10001 --gid 10001 kvserve
COPY --from=build /opt/kvserve /opt/kvserve
# By number: a pod's runAsNonRoot can check a number, not a name
USER 10001:10001
WORKDIR /home/kvserve

# 50051: model service / gateway (Inference API). The KV-cache manager `up` starts listens inside
# the container only; deploy/ runs it as a sidecar on a Unix socket.
EXPOSE 50051
# The whole stack on the built-in tiny model; give --model /models/NAME for a real checkpoint.
CMD ["kvserve", "up", "--model", "tiny", "--listen", "0.0.0.0:50051"]
