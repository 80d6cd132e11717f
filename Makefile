# The two commands of the README, and a few more.
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# gpu-check runs where torch is already installed (an offline GPU machine has no .venv): the venv's
# python when there is one, else python3
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

.PHONY: venv capstone test test-all test-fast lint lint-fix guide gpu-check gpu-bundle slurm-up slurm-down clean

venv:
	@scripts/setup-venv

capstone: venv          ## run every experiment at small size on local ranks, then the guide
	$(BIN)/dtrain capstone

test: venv              ## the suite CI runs: all but the slow tests (slurm tests skip unless a cluster is up)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: venv          ## every test, the slow ones too (about twice as long)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv         ## the fast path: every subproject, no slow or slurm tests
	$(BIN)/python -m pytest -m "not slow and not slurm" $(PYTEST_ARGS)

lint: venv              ## ruff: the lint (pyflakes, pycodestyle, lines <= 100 columns) and the format check
	@rc=0; $(BIN)/ruff check . || rc=$$?; $(BIN)/ruff format --check . || rc=$$?; exit $$rc

lint-fix: venv          ## ruff format, then split what is still over 100 columns (what is left: by hand)
	VENV=$(VENV) $(BIN)/python scripts/lint-fix

guide: venv             ## regenerate PARALLELISM_GUIDE.md from the latest capstone's inputs
	$(BIN)/dtrain guide

gpu-check:              ## on one CUDA GPU: gpu tests + bounded measurements -> one markdown report (< 30 min)
	@PYTHON=$(GPU_PYTHON) scripts/gpu-check

gpu-bundle:             ## on a networked machine: the wheels gpu-check needs offline, into .whl/ (< 64 MiB)
	@scripts/gpu-bundle

SLURM_NODES ?= 2
slurm-up:               ## a local Slurm cluster, 2 nodes in network namespaces (root, Debian)
	scripts/slurm-cluster install && scripts/slurm-cluster start --nodes $(SLURM_NODES)

slurm-down:
	scripts/slurm-cluster stop

clean:
	rm -rf results outputs multirun .pytest_cache
