# The two commands a newcomer needs: `make test` (and, once the gateway lands, `make up`).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS := operator,serving,gateway,test,dev

.PHONY: install k8s-binaries lint format test test-unit test-k8s up clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required (set PYTHON=...)")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null
	$(BIN)/pip install -e '.[$(EXTRAS)]'
	touch $@

# Real Kubernetes binaries (etcd, kube-apiserver, ..., kwok, helm), built once into ~/.cache/dsv4.
k8s-binaries:
	scripts/k8s-test-binaries

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy operator/dsv4_operator kvtransfer/dsv4_kvtransfer
	$(BIN)/lint-imports

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Every tier; pytest exits non-zero (5) when it collects no test, so an empty run fails.
test: install lint
	DSV4_K8S_BIN_DIR="$$(scripts/k8s-test-binaries | tail -n 1)" $(BIN)/pytest $(PYTEST_ARGS)

test-unit: install
	$(BIN)/pytest -m unit $(PYTEST_ARGS)

test-k8s: install
	DSV4_K8S_BIN_DIR="$$(scripts/k8s-test-binaries | tail -n 1)" $(BIN)/pytest -m k8s $(PYTEST_ARGS)

# The local stack on the built-in tiny model: gateway on 127.0.0.1:8000, one prefill and one
# decode engine with their KV sidecars. Ctrl-C stops it. UP_ARGS='--port 9000' etc. pass through.
up: install
	$(BIN)/dsv4 up $(UP_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
