# kimi-vision-triton: `make run` (the main job) and `make test` work on a fresh machine; both set up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt | md5sum | cut -c1-8)
PERF_DIR := $(VENV)/perf_analyzer
PERF_STAMP := $(PERF_DIR)/.installed

DEVICE ?= auto
CHECKPOINT ?= $(KIMI_VISION_CHECKPOINT)
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
CKPT_ARG := $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT),)

.PHONY: setup run serve test unit integration validate configs perf soak clean

setup: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	@rm -f $(VENV)/.installed-*; touch $@

run: setup
	$(PY) -m clients.demo --device $(DEVICE) $(CKPT_ARG)

serve: setup
	$(PY) -m backends.deploy.launcher --device $(DEVICE) $(CKPT_ARG) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

validate: setup
	$(PY) -m backends.deploy.validate model_repository

# Re-render the committed CPU configs after changing backends/deploy/repository.py.
configs: setup
	$(PY) -m backends.deploy.repository --write-source

test: setup validate
	$(PY) -m pytest -q tests

unit: setup
	$(PY) -m pytest -q tests/unit

integration: setup
	$(PY) -m pytest -q tests/integration

# perf_analyzer comes from the tritonclient 2.48 wheel (the last one that ships the binary), kept in
# its own folder so the newer tritonclient stays our Python client; it needs libb64 and libcudart 12.
$(PERF_STAMP): $(STAMP)
	@command -v apt-get >/dev/null && ! ldconfig -p | grep -q libb64.so.0d && \
		(apt-get update -qq && apt-get install -y -qq libb64-0d) || true
	$(PY) -m pip install -q --no-deps --target $(PERF_DIR) tritonclient==2.48.0 nvidia-cuda-runtime-cu12==12.6.77
	touch $@

perf: $(PERF_STAMP)
	$(PY) -m bench.perf --device $(DEVICE) $(CKPT_ARG) --perf-dir $(PERF_DIR) --concurrency 1,2,4 --ensembles plain,batched

# Mixed good and bad requests at a fixed concurrency, memory sampled as it goes (bench/soak.py).
SOAK_REQUESTS ?= 2000
soak: setup
	$(PY) -m bench.soak --device $(DEVICE) $(CKPT_ARG) --requests $(SOAK_REQUESTS)

clean:
	rm -rf build .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
