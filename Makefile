# The two commands of the README, and a few more.
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: venv capstone test test-fast guide slurm-up slurm-down clean

venv:
	@scripts/setup-venv

capstone: venv          ## run every experiment at small size on local ranks, then the guide
	$(BIN)/dtrain capstone

test: venv              ## the whole suite (slurm tests skip unless a cluster is up)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv         ## the fast path: every subproject, no slow or slurm tests
	$(BIN)/python -m pytest -m "not slow and not slurm" $(PYTEST_ARGS)

guide: venv             ## regenerate PARALLELISM_GUIDE.md from results/
	$(BIN)/dtrain guide

SLURM_NODES ?= 2
slurm-up:               ## a local Slurm cluster, 2 nodes in network namespaces (root, Debian)
	scripts/slurm-cluster install && scripts/slurm-cluster start --nodes $(SLURM_NODES)

slurm-down:
	scripts/slurm-cluster stop

clean:
	rm -rf results outputs multirun .pytest_cache
