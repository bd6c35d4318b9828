# The two commands a newcomer needs: `make up` (the local stack) and `make test` (every tier).
SHELL := /bin/bash
comma := ,
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS := operator,serving,gateway,devcluster,test,dev
# every package the tests run with, pinned; `make lock` refreshes it from pyproject.toml
LOCK := requirements.lock
# the test tiers: one pytest marker and one directory under tests/ each; `make test-<tier>` runs one
TIERS := unit model engine pd gateway k8s dist node
TIER_TARGETS := $(addprefix test-,$(TIERS))

.PHONY: install lock k8s-binaries node-prereqs early-images lint format test $(TIER_TARGETS) up clean

# The node tier runs real pods (containerd, runc, kubelet) and needs root: as root the test
# binaries include the node's (kubelet, kube-proxy, crictl, coredns); otherwise the tier skips
# with that reason.
ifeq ($(shell id -u),0)
NODE_BINARIES := --node
endif
K8S_BIN_DIR = $$(scripts/k8s-test-binaries $(NODE_BINARIES) | tail -n 1)
# A full `make test` as root starts building the node tier's images at once, in the background
# (downloads and disk, mostly: the Python base, torch's layer) while pip, the kernels and the Go
# binaries take the CPUs; the tier's fixture runs the same script, which waits on its lock and
# finds them cached. Warm, it only checks its keys. Its log: $(IMAGES_LOG).
IMAGES_LOG = $${DSV4_CACHE_DIR:-$$HOME/.cache/dsv4}/node-images.log
ifeq ($(NODE_BINARIES)|$(PYTEST_ARGS),--node|)
EARLY_IMAGES := early-images
endif

install: $(STAMP)

# The exact versions of requirements.lock, then the project itself (editable, no resolution).
$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required (set PYTHON=...)")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null
	$(BIN)/pip install -r $(LOCK)
	$(BIN)/pip install --no-deps -e .
	@# the CPU kernels (g++ + ninja; cached in ~/.cache/torch_extensions/dsv4-<venv>): built here once, not
	@# inside the first engine or test that needs them (they fall back to torch without a compiler);
	@# as many at once as there are CPUs
	$(BIN)/python -m dsv4_serving.kernels.build
	touch $@

# Re-resolve every extra at today's newest versions (Linux x86-64, Python 3.11), then `make test`
# and commit requirements.lock with the change that needed it.
lock: install
	$(BIN)/uv pip compile pyproject.toml $(foreach e,$(subst $(comma), ,$(EXTRAS)),--extra $(e)) \
		--python-version 3.11 --upgrade --no-header --annotation-style line -o $(LOCK)
	$(BIN)/pip install -r $(LOCK)

# Real Kubernetes binaries (etcd, kube-apiserver, ..., kwok, helm), built once into ~/.cache/dsv4.
k8s-binaries:
	scripts/k8s-test-binaries $(NODE_BINARIES)

# Host packages (containerd, runc, CNI plugins, buildah, debootstrap) and the node tier's
# images (pause, busybox; engine and operator from docker/*.Dockerfile), all cached.
node-prereqs:
	scripts/node-host-packages
	scripts/node-images --app

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy common/dsv4_common operator/dsv4_operator kvtransfer/dsv4_kvtransfer \
		serving/dsv4_serving/distributed serving/dsv4_serving/eplb serving/dsv4_serving/kernels \
		serving/dsv4_serving/chat serving/dsv4_serving/structured \
		devcluster/dsv4_devcluster
	$(BIN)/lint-imports

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

early-images:
	@command -v buildah >/dev/null || { echo "[make] buildah missing: the node tier's images build later, if at all" >&2; exit 0; }; \
	mkdir -p "$$(dirname $(IMAGES_LOG))" && (scripts/node-images --app >$(IMAGES_LOG) 2>&1 &) && \
	echo "[make] building the node images in the background: $(IMAGES_LOG)" >&2

# Every tier; pytest exits non-zero (5) when it collects no test, so an empty run fails.
# SIDE_BY_SIDE=1: the cluster tiers run beside the rest (scripts/test-side-by-side), about 20
# min instead of 27 on 2 cores, but timing-sensitive tests can fail under the doubled load
# (docs/measurements.md, "Build and test times"); with PYTEST_ARGS, always one run.
TEST_RUNNER = $(if $(and $(SIDE_BY_SIDE),$(if $(strip $(PYTEST_ARGS)),,1)),scripts/test-side-by-side)

test: $(EARLY_IMAGES) install lint
	DSV4_K8S_BIN_DIR="$(K8S_BIN_DIR)" DSV4_JAEGER_BIN="$$(scripts/trace-backend | tail -n 1)" $(TEST_RUNNER) $(BIN)/pytest --durations=30 $(PYTEST_ARGS)

# What a tier needs beside the venv: the Kubernetes binaries (k8s, node) and the Jaeger binary
# (the gateway tier's tracing tests; built on first use otherwise).
TIER_ENV_k8s = DSV4_K8S_BIN_DIR="$(K8S_BIN_DIR)"
TIER_ENV_node = DSV4_K8S_BIN_DIR="$(K8S_BIN_DIR)"
TIER_ENV_gateway = DSV4_JAEGER_BIN="$$(scripts/trace-backend | tail -n 1)"

$(TIER_TARGETS): test-%: install
	$(TIER_ENV_$*) $(BIN)/pytest -m $* $(PYTEST_ARGS)

# The local stack on the built-in tiny model: gateway on 127.0.0.1:8000, one prefill and one
# decode engine with their KV sidecars. Ctrl-C stops it. UP_ARGS='--port 9000' etc. pass through.
up: install
	$(BIN)/dsv4 up $(UP_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
