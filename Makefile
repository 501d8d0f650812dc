# gpuhub developer entry points. `make demo` and `make test` are all a newcomer needs.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-down test test-unit test-fast test-gpu test-cluster bench lint venv host-deps clean

$(STAMP): pyproject.toml requirements/dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -r requirements/dev.txt
	$(BIN)/pip install -q -e .
	touch $@

venv: $(STAMP)

# torch for the faithfulness tests (requirements/torch.txt): test targets only, not `make demo`.
TORCH := $(VENV)/.torch-installed
$(TORCH): $(STAMP) requirements/torch.txt
	$(BIN)/pip install -q -r requirements/torch.txt
	touch $@

# Debian packages the controller needs to run the local podman cluster (docs/testing.md).
host-deps:
	scripts/host-deps.sh

# A local cluster (podman: hub1 + gpu1..gpu3 with fake GPUs), deployed with site.yml; prints the
# hub URL and the demo users' generated passwords. `make demo-down` removes it.
demo: venv host-deps
	scripts/cluster.sh up demo
	scripts/cluster.sh deploy demo
	scripts/cluster.sh info demo

demo-down:
	scripts/cluster.sh down demo

# tests/unit and tests/sim: no process, no socket (seconds). test-fast adds tests/integration and
# tests/monitoring (real daemons, kernels and Prometheus on 127.0.0.1).
test-unit: venv
	$(BIN)/pytest -q -m unit tests

test-fast: venv $(TORCH)
	$(BIN)/pytest -q -m "not cluster" tests

# On a machine with an NVIDIA GPU (and PyTorch for it): the tests that need one (docs/testing.md).
# Elsewhere they skip, saying why.
test-gpu: venv $(TORCH)
	$(BIN)/pytest -q -rs -m gpu tests

# The molecule scenario: a fresh cluster "ci", site.yml, idempotence (changed=0), the end-to-end
# tests (pytest -m cluster), then the cluster is removed.
test-cluster: venv host-deps
	scripts/host-deps.sh browser
	@mkdir -p .cache && rm -f .cache/cluster-tests.log
	PATH="$(CURDIR)/$(BIN):$$PATH" GPUHUB_CLUSTER=ci $(BIN)/molecule test -s cluster \
		|| { scripts/cluster-test-summary.sh .cache/cluster-tests.log; exit 2; }

test: venv $(TORCH) host-deps lint
	$(BIN)/pytest -q --durations=25 -m "not cluster" tests
	$(MAKE) --no-print-directory test-cluster

bench: venv
	$(BIN)/python -m bench

lint: venv
	scripts/lint.sh

clean:
	rm -rf $(VENV) .cache
