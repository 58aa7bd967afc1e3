# One entry point for people and CI. Every target installs what it needs first.
# torch is installed first and pinned: a looser requirement can pull a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: install test test-fast lint format demo docs bench

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[local,test,docs,lint]"
	touch $@

test: install
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: install
	$(PY) -m pytest -q -m "not real_model"

# The static gate CI runs before the tests: lint, formatting, types, and arrows pointing one way.
lint: install
	$(VENV)/bin/ruff check src tests bench scripts
	$(VENV)/bin/ruff format --check src tests bench scripts
	$(VENV)/bin/mypy
	$(PY) scripts/check_layers.py

format: install
	$(VENV)/bin/ruff check --fix src tests bench scripts
	$(VENV)/bin/ruff format src tests bench scripts

demo: install
	$(VENV)/bin/gymserve demo

docs: install
	$(VENV)/bin/mkdocs build --strict

# Benchmarks: regenerates docs/performance.md and docs/assets/perf/ (full mode: tens of minutes;
# builds .venv-peer and .venv-nemo for the peers on first use). BENCH_ARGS=--quick for a short run.
bench: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/run_all.py $(BENCH_ARGS)
