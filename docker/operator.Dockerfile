# The control-plane image: `dsv4 operator` and `dsv4 gateway`. No torch, no engine.
#
#   docker build -f docker/operator.Dockerfile -t dsv4/operator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /opt/dsv4
COPY pyproject.toml README.md requirements.lock ./
COPY common ./common
COPY operator ./operator
COPY serving ./serving
COPY kvtransfer ./kvtransfer

RUN python -m pip install -c requirements.lock ".[operator,gateway]" \
 && useradd --uid 1000 --create-home --shell /usr/sbin/nologin dsv4 \
 && python -c "import dsv4_operator.handlers, sys; assert 'torch' not in sys.modules"

USER 1000
ENTRYPOINT ["dsv4"]
CMD ["operator", "--all-namespaces"]
