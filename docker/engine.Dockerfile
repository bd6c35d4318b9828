# The engine image: `dsv4 engine` and `dsv4 kv-sidecar` on Ascend NPUs.
#
#   docker build -f docker/engine.Dockerfile \
#     --build-arg BASE_IMAGE=<registry>/ascend/cann:8.1.rc1-910b-ubuntu22.04-py3.11 \
#     --build-arg TORCH_VERSION=2.5.1 --build-arg TORCH_NPU_VERSION=2.5.1 \
#     -t dsv4/engine:0.1.0 .
#
# BASE_IMAGE must carry the CANN toolkit (set_env.sh under /usr/local/Ascend) and Python 3.11;
# the NPU driver itself is mounted from the host by the operator (/usr/local/Ascend/driver).
# For CPU-only development images use BASE_IMAGE=python:3.11-slim and leave TORCH_NPU_VERSION empty.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# the torch the tests ran with (requirements.lock); Ascend images pass the one torch_npu needs
ARG TORCH_VERSION=2.15.0
ARG TORCH_NPU_VERSION=""
ARG TORCH_INDEX_URL=""

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    ASCEND_HOME=/usr/local/Ascend \
    LD_LIBRARY_PATH=/usr/local/Ascend/driver/lib64/driver:/usr/local/Ascend/driver/lib64/common:${LD_LIBRARY_PATH}

WORKDIR /opt/dsv4
COPY pyproject.toml README.md requirements.lock ./
COPY common ./common
COPY operator ./operator
COPY serving ./serving
COPY kvtransfer ./kvtransfer

RUN python -m pip install --upgrade pip \
 && if [ -n "${TORCH_INDEX_URL}" ]; then \
        python -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    else \
        python -m pip install "torch==${TORCH_VERSION}"; \
    fi \
 && if [ -n "${TORCH_NPU_VERSION}" ]; then python -m pip install "torch_npu==${TORCH_NPU_VERSION}"; fi \
 && grep -v '^torch==' requirements.lock > /tmp/constraints.txt \
 && python -m pip install -c /tmp/constraints.txt ".[serving]" \
 && useradd --uid 1000 --create-home --shell /usr/sbin/nologin dsv4

# CANN's environment for every process of the container (no-op on CPU images).
RUN printf '%s\n' '#!/bin/sh' \
      '[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ] && . /usr/local/Ascend/ascend-toolkit/set_env.sh' \
      'exec "$@"' > /usr/local/bin/dsv4-entry && chmod 0755 /usr/local/bin/dsv4-entry

USER 1000
ENTRYPOINT ["/usr/local/bin/dsv4-entry"]
CMD ["dsv4", "--help"]
