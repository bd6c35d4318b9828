# The engine image: `dsv4 engine` and `dsv4 kv-sidecar` on Ascend NPUs (or CPU, for tests).
#
#   docker build -f docker/engine.Dockerfile \
#     --build-arg BASE_IMAGE=<registry>/ascend/cann:8.1.rc1-910b-ubuntu22.04-py3.11 \
#     --build-arg TORCH_VERSION=2.5.1 --build-arg TORCH_NPU_VERSION=2.5.1 \
#     -t dsv4/engine:0.1.0 .
#
# BASE_IMAGE must carry the CANN toolkit (set_env.sh under /usr/local/Ascend) and Python 3.11;
# the NPU driver itself is mounted from the host by the operator (/usr/local/Ascend/driver).
# For CPU-only development images use BASE_IMAGE=python:3.11-slim and leave TORCH_NPU_VERSION empty
# (scripts/node-images builds this same file with buildah, on a Debian base, for the node tier).
ARG BASE_IMAGE=python:3.11-slim

# Stage 0 (nothing of it ships): the dependency lists of the image's extras and the lock's pins,
# without its comments, out of pyproject.toml and requirements.lock. Layer 1 copies only these two
# files, and a COPY is cached by content, so editing a tool setting in pyproject.toml (or a
# lock comment) does not rebuild torch's layer; a changed pin or dependency list does.
FROM ${BASE_IMAGE} AS reqs
WORKDIR /reqs
COPY pyproject.toml requirements.lock ./
RUN python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["serving"]))' > deps.txt \
 && sed -n 's/^\([A-Za-z0-9_.-]*==[^ ]*\).*/\1/p' requirements.lock | grep -v '^torch==' > constraints.txt \
 && rm pyproject.toml requirements.lock

FROM ${BASE_IMAGE} AS deps

# the torch the tests ran with (requirements.lock); Ascend images pass the one torch_npu needs
ARG TORCH_VERSION=2.15.0
ARG TORCH_NPU_VERSION=""
ARG TORCH_INDEX_URL=""
# a CA bundle for pip behind a TLS-inspecting proxy (a path visible to RUN, e.g. a build volume)
ARG PIP_CERT
# 0 leaves out triton (1 GB; torch imports without it and the engine never compiles kernels).
# PyPI's torch needs its CUDA libraries (nvidia-*, 3 GB) even on CPU: libtorch_python links them.
ARG WITH_TRITON=1

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ASCEND_HOME=/usr/local/Ascend \
    LD_LIBRARY_PATH=/usr/local/Ascend/driver/lib64/driver:/usr/local/Ascend/driver/lib64/common:${LD_LIBRARY_PATH}

WORKDIR /opt/dsv4
# Layer 1, the dependencies: torch, then every dependency of the `serving` extra at
# requirements.lock's versions (stage 0's two files), rebuilt (and re-imported) only when the
# dependencies change, not per commit.
COPY --from=reqs /reqs/ /tmp/reqs/
RUN if [ -n "${TORCH_INDEX_URL}" ]; then \
        python -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    else \
        python -m pip install "torch==${TORCH_VERSION}"; \
    fi \
 && if [ -n "${TORCH_NPU_VERSION}" ]; then python -m pip install "torch_npu==${TORCH_NPU_VERSION}"; fi \
 && python -m pip install -c /tmp/reqs/constraints.txt -r /tmp/reqs/deps.txt \
 && if [ "${WITH_TRITON}" = 0 ]; then python -m pip uninstall -y triton; fi \
 && python -c "import torch" \
 && rm -r /tmp/reqs \
 && useradd --uid 1000 --create-home --shell /usr/sbin/nologin dsv4

# CANN's environment for every process of the container (no-op on CPU images).
RUN printf '%s\n' '#!/bin/sh' \
      '[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ] && . /usr/local/Ascend/ascend-toolkit/set_env.sh' \
      'exec "$@"' > /usr/local/bin/dsv4-entry && chmod 0755 /usr/local/bin/dsv4-entry

FROM deps
# (a build argument is per stage)
ARG PIP_CERT
# Layer 2, per commit: the project itself, its dependencies already in place (a few MB).
COPY pyproject.toml README.md ./
COPY common ./common
COPY operator ./operator
COPY serving ./serving
COPY kvtransfer ./kvtransfer
RUN python -m pip install --no-deps . && rm -rf build *.egg-info

USER 1000
ENTRYPOINT ["/usr/local/bin/dsv4-entry"]
CMD ["dsv4", "--help"]
