# The README's two commands: `make demo` and `make test`. Both create .venv and install first.
# Without an NVIDIA GPU the install is pinned to the CPU torch build (constraints-cpu.txt), so pip
# never pulls CUDA wheels; with one, pip takes the CUDA torch the registry serves.
VENV   ?= .venv
PYTHON ?= python3
PIP     = $(VENV)/bin/pip
# pytest-xdist processes on the 2-core machines CI and the developers run on: one more than the cores, since
# the minutes-long tests wait much of their time (on Prefect servers and workers, on automations' windows);
# each process computes with one thread (tests/conftest.py). From a fresh clone, the whole suite (handed out
# by work stealing then): 2 processes 1,739 s, 3 processes 1,477 s, 4 processes 1,539 s. Whole modules go
# to whichever process is free, the longest first (tests/conftest.py MODULE_SECONDS): the processes end
# together.
TEST_WORKERS ?= 3
PYTEST = $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_PIN := $(if $(HAS_GPU),,-c constraints-cpu.txt)

# No bytecode is compiled at install (pip's --no-compile below): Python writes a module's bytecode the first
# time it is imported, as it does by default, and make's commands undo a PYTHONDONTWRITEBYTECODE=1 of the
# caller's environment so that it can. The whole suite imports 10,062 of the 23,500 files installed; compiling
# all of them at install took 65 s of the 136 s install on the 2-core machine, and `make test` from a fresh
# clone took 1,275 s in all instead of 1,335 s with it.
export PYTHONDONTWRITEBYTECODE :=

# Freed memory stays with the process that freed it, in every process make starts (the test processes train
# in-process too), as `vlmexp run` has it for its stages (vlmexp/pipeline/processes.py HELD_MEMORY): an SFT
# step's large tensors are not faulted in again at every step. A value the caller set is kept.
export MALLOC_MMAP_THRESHOLD_ ?= 1073741824
export MALLOC_TRIM_THRESHOLD_ ?= 1073741824

.PHONY: install install-demo chromium demo test test-fast clean

# The demo's install: the package and its dependencies, none of the extras. `make demo` imports nothing of
# the test extra, of Kubernetes' work pool or of Ray, and DeepSpeed, which `make install` builds from its
# sdist, is imported by transformers and TRL in each process where it is installed (1.7 s of a stage's start,
# bench/RESULTS.md).
$(VENV)/.installed-demo: pyproject.toml constraints.txt constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(if $(HAS_GPU),,$(PIP) install -q --no-compile torch==2.13.0 $(TORCH_PIN))
	$(PIP) install -q --no-compile -c constraints.txt $(TORCH_PIN) -e .
	touch $@

# Everything the tests need, over the demo's install.
$(VENV)/.installed: $(VENV)/.installed-demo
	$(PIP) install -q --no-compile -c constraints.txt $(TORCH_PIN) -e '.[test,k8s,ray]'
	# DeepSpeed from its sdist without compiling ops (JIT-built on a GPU box when first used);
	# without build isolation so it builds against the torch installed above.
	DS_BUILD_OPS=0 $(PIP) install -q --no-compile --no-build-isolation -c constraints.txt $(TORCH_PIN) deepspeed
	touch $@

install: $(VENV)/.installed

install-demo: $(VENV)/.installed-demo

# tests/test_mlflow_ui.py renders the MLflow UI in headless Chromium: installed from the system's packages
# where apt-get runs as root (CI); elsewhere install it yourself: without it that test fails, it is not skipped.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	  else echo "chromium is missing and apt-get as root is not here to install it: tests/test_mlflow_ui.py will fail"; fi

demo: install-demo
	$(VENV)/bin/vlmexp run configs/demo.yaml

# the two installs side by side (Chromium's comes from the system's packages, the rest from pip)
test:
	$(MAKE) --no-print-directory -j2 install chromium
	$(PYTEST) --durations=15

# The inner loop: every test not marked slow (those that train or start servers).
test-fast: install
	$(PYTEST) -m "not slow" --durations=10

clean:
	rm -rf $(VENV) outputs
