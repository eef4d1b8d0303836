# kimi-vision-triton: `make run` (the main job) and `make test` work on a fresh machine; both set up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt | md5sum | cut -c1-8)
PERF_DIR := $(VENV)/perf_analyzer
PERF_STAMP := $(PERF_DIR)/.installed

DEVICE ?= $(or $(KIMI_DEVICE),auto)
CHECKPOINT ?= $(KIMI_VISION_CHECKPOINT)
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
CKPT_ARG := $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT),)

.PHONY: setup jemalloc compiler run serve test unit integration lab-test validate configs perf soak image-test clean

setup: $(STAMP) jemalloc

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	@rm -f $(VENV)/.installed-*; touch $@

# jemalloc, which the launcher preloads for tritonserver and its stubs so that heap memory returns after
# a peak (backends/deploy/allocator.py): the system's where there is one, else Debian's libjemalloc2
# unpacked into the virtualenv (apt-get download needs no root). Not fatal: without it the server runs
# on glibc's malloc and the launcher says so.
JEMALLOC := $(VENV)/lib/jemalloc/libjemalloc.so.2
jemalloc: $(STAMP)
	@if ! ls /usr/lib/*-linux-gnu/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2 >/dev/null 2>&1 && [ ! -f $(JEMALLOC) ]; then \
	  tmp=$$(mktemp -d); \
	  if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
	     && (cd $$tmp && apt-get download -q libjemalloc2 >/dev/null 2>&1) \
	     && dpkg-deb -x $$tmp/libjemalloc2_*.deb $$tmp/x && mkdir -p $(dir $(JEMALLOC)) \
	     && cp $$tmp/x/usr/lib/*/libjemalloc.so.2 $(JEMALLOC); then \
	    echo "jemalloc: Debian's libjemalloc2 unpacked into $(JEMALLOC)"; \
	  else echo "note: no jemalloc here (apt-get download libjemalloc2 failed); the server runs on glibc's malloc"; fi; \
	  rm -rf $$tmp; \
	fi

# The tests build the JPEG scan check (backends/preprocess/scan_check.c) with the host's C compiler.
compiler:
	@cc="$${CC:-cc}"; command -v "$${cc%% *}" >/dev/null || { echo "make test needs a C compiler ($$cc; set CC to another): the JPEG scan check's tests build it"; exit 1; }

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

test: setup compiler validate
	$(PY) -m pytest -q tests

unit: setup compiler
	$(PY) -m pytest -q tests/unit

integration: setup
	$(PY) -m pytest -q tests/integration

# The lab's own tests (benchmark helpers, lab/tests): CI runs them after `make test`.
lab-test: setup
	$(PY) -m pytest -q lab/tests

# perf_analyzer comes from the tritonclient 2.48 wheel (the last one that ships the binary), kept in
# its own folder so the newer tritonclient stays our Python client. It needs libcudart 12 (a wheel) and
# libb64.so.0d: where the system lacks it, the Debian package is fetched into that folder with
# `apt-get download` and unpacked there (said out loud; nothing is installed system-wide); without
# apt-get, make stops and says what to install.
$(PERF_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(PERF_DIR) tritonclient==2.48.0 nvidia-cuda-runtime-cu12==12.6.77
	@if ldconfig -p | grep -q libb64.so.0d || [ -e $(PERF_DIR)/lib/libb64.so.0d ]; then :; \
	elif command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then \
		echo "perf_analyzer needs libb64.so.0d: fetching Debian's libb64-0d into $(PERF_DIR)/lib (apt-get download, no install)"; \
		cd $(PERF_DIR) && apt-get -q -o APT::Sandbox::User=$$(id -un) download libb64-0d && dpkg-deb -x libb64-0d_*.deb b64 && mkdir -p lib && cp -P b64/usr/lib/*/libb64.so.0d* lib/; \
	else echo "perf_analyzer needs libb64.so.0d: install it (Debian/Ubuntu: libb64-0d) and run make perf again"; exit 1; fi
	touch $@

# make perf                 start a server here and measure it
# make perf URL=host:8001   measure a running server (gRPC address)
# Each rewrites its section of lab/results/<machine>.md (lab/RESULTS.md indexes what the docs quote).
# make perf TRACE=multiturn: chats that resend their earlier images, with the embedding cache on and off
perf: $(PERF_STAMP)
ifeq ($(TRACE),multiturn)
	$(PY) -m lab.bench.multiturn --device $(DEVICE) $(CKPT_ARG) --chats 4 --turns 4 --sizes 448,640,1024 --pairs 5 \
		--section multiturn
else
	$(PY) -m lab.bench.perf --device $(DEVICE) $(CKPT_ARG) --perf-dir $(PERF_DIR) --concurrency 1,2,4 --ensembles plain,batched \
		$(if $(URL),--url $(URL),--section perf-sample)
endif

# Mixed good and bad requests at a fixed concurrency, memory sampled as it goes (lab/bench/soak.py).
SOAK_REQUESTS ?= 2000
soak: setup
	$(PY) -m lab.bench.soak --device $(DEVICE) $(CKPT_ARG) --requests $(SOAK_REQUESTS) --section soak

# The image for real (docker/build_and_run.sh): podman and debootstrap from apt where absent, a Debian base made
# here, docker/Dockerfile built on it with KIMI_DEVICE=cpu, run, `make run`'s request sent to it and its checksum
# checked against the README's. Needs root (or sudo); about 3 minutes from nothing (CI runs it).
image-test: setup
	bash docker/build_and_run.sh

clean:
	rm -rf build .pytest_cache lab/out
	find . -name __pycache__ -prune -exec rm -rf {} +
