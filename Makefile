# Set-up and checks. Each target installs what it needs first, so a fresh machine needs nothing else.
PYTHON ?= python3
# vLLM's CUDA wheel where an NVIDIA driver is present, its CPU wheel elsewhere.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
PYTEST = $(PYTHON) -m pytest -q -rs
# Every version pinned on CPU machines (CI and developers) by the lock that `make lock` rewrites; pip fails if it
# is missing. The CUDA extra has no lock yet (README).
LOCK = requirements/$(VLLM_EXTRA).lock.txt
CONSTRAINTS = $(if $(filter cpu,$(VLLM_EXTRA)),-c $(LOCK))
LOCK_VENV = .lock-venv

.PHONY: install lock test demo

install:
	$(PYTHON) -m pip install -q $(CONSTRAINTS) -e '.[$(VLLM_EXTRA),test]'
	$(PYTHON) -c 'from vllm_treewy.cpu_compat import install; print(install())'

# Kernels and adapter first, then the vLLM end-to-end tests in their own process (vLLM binds the process's
# CPU threads when an engine starts).
test: install
	$(PYTEST) tests --ignore=tests/e2e
	$(PYTEST) tests/e2e

# Resolves the extras afresh in a new virtual environment and pins what it got.
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q -e '.[$(VLLM_EXTRA),test]'
	{ echo "# Every package that \`make install\` brings on a $(VLLM_EXTRA) machine, pinned (pip constraints). Regenerate: \`make lock\`."; \
	  $(LOCK_VENV)/bin/pip freeze --exclude-editable; } > $(LOCK)
	rm -rf $(LOCK_VENV)

demo: install
	$(PYTHON) -m vllm_treewy.vllm_plugin.demo
