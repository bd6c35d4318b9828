# The control-plane image: `dsv4 operator` and `dsv4 gateway`. No torch, no engine.
#
#   docker build -f docker/operator.Dockerfile -t dsv4/operator:0.1.0 .
#
# (scripts/node-images builds this same file with buildah, on a Debian base, for the node tier.)
ARG BASE_IMAGE=python:3.11-slim

# Stage 0 (nothing of it ships): the extras' dependency lists and the lock's pins, so that layer 1
# is rebuilt only when those change, not on a tool-setting edit (see engine.Dockerfile).
FROM ${BASE_IMAGE} AS reqs
WORKDIR /reqs
COPY pyproject.toml requirements.lock ./
RUN python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; e = p["optional-dependencies"]; print("\n".join(p["dependencies"] + e["operator"] + e["gateway"]))' > deps.txt \
 && sed -n 's/^\([A-Za-z0-9_.-]*==[^ ]*\).*/\1/p' requirements.lock > constraints.txt \
 && rm pyproject.toml requirements.lock

FROM ${BASE_IMAGE} AS deps

# a CA bundle for pip behind a TLS-inspecting proxy (a path visible to RUN, e.g. a build volume)
ARG PIP_CERT

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/dsv4
# Layer 1, the dependencies of the `operator` and `gateway` extras at requirements.lock's versions.
COPY --from=reqs /reqs/ /tmp/reqs/
RUN python -m pip install -c /tmp/reqs/constraints.txt -r /tmp/reqs/deps.txt \
 && rm -r /tmp/reqs \
 && useradd --uid 1000 --create-home --shell /usr/sbin/nologin dsv4

FROM deps
# (a build argument is per stage)
ARG PIP_CERT
# Layer 2, per commit: the project itself.
COPY pyproject.toml README.md ./
COPY common ./common
COPY operator ./operator
COPY serving ./serving
COPY kvtransfer ./kvtransfer
# (the dev cluster, devcluster/, is not copied: nor is its `cryptography`; the check says so)
RUN python -m pip install --no-deps . && rm -rf build *.egg-info \
 && python -c "import dsv4_operator.handlers, sys; assert 'torch' not in sys.modules" \
 && python -c "import importlib.util as u; assert not u.find_spec('cryptography') and not u.find_spec('dsv4_devcluster')"

USER 1000
ENTRYPOINT ["dsv4"]
CMD ["operator", "--all-namespaces"]
