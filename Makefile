# rayjobs: `make train` runs the default job; `make test` runs the whole suite.
# Both set up .venv first when needed (CPU torch where there is no GPU).

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH_CPU_VERSION ?= 2.13.0
PYTEST_FLAGS ?=
# Processes per run (pytest-xdist, one test module per unit of work; 1: none). The quick tiers gain
# from 2 (3 took 4:03 against 3:48 with 2, 2026-12-05). The Ray tiers are CPU-bound on 2 cores (Ray's
# own processes), but a run leaves a third of the CPUs idle while Ray starts and its processes wait on
# each other: 2 at once took 22:38 against 29:02 one at a time (2026-12-07); 3 ran at a load of 11,
# no sooner, and an elastic-run test missed its deadline. Modules run side by side share no port or
# process: local Rays take free ports, and each test stops only what it started.
TEST_WORKERS ?= 2
FAST_WORKERS ?= 2
# The quick tiers (`make test-fast`), and every other test (`make test` runs both, in that order).
FAST_TESTS := -m "(unit or dist) and not ray and not slow" tests/unit tests/dist
REST_TESTS  = -m "not ((unit or dist) and not ray and not slow)" $(TIERS)
xdist = $(if $(filter 1,$(1)),,-n $(1) --dist loadfile --no-loadscope-reorder)

export PATH := $(abspath $(VENV))/bin:$(PATH)
# Python caches compiled code (__pycache__): a machine that says not to (this one sets
# PYTHONDONTWRITEBYTECODE=1) compiled rayjobs afresh in every CLI run, Ray worker and rank, 0.2-0.5 s each.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup browser train test test-fast lint format bench bench-quick clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "setup: GPU found: installing a CUDA build of torch"; \
	    $(PY) -m pip install -q 'torch>=2.6,<2.15'; \
	else \
	    echo "setup: no GPU: installing the CPU build torch==$(TORCH_CPU_VERSION)"; \
	    $(PY) -m pip install -q "torch==$(TORCH_CPU_VERSION)"; \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

train: setup
	$(VENV)/bin/rayjobs train --summary results/summary.json

# Debian's Chromium, for the MLflow UI screenshot test (skipped, with its reason, where it can't be had).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "setup: installing Debian's chromium (MLflow UI screenshot test)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "setup: chromium could not be installed: the screenshot test will skip"; \
	  else echo "setup: no chromium and no root apt-get: the screenshot test will skip"; fi; }

# Tiers in order, quickest first: unit, dist (gloo, local mode, servers), ray, cluster, the README.
TIERS := tests/unit tests/dist tests/ray tests/cluster tests/test_readme.py

# Both parts run even when the first fails, so that one run shows every failure.
test: setup browser
	@rc=0; \
	$(PY) -m pytest $(call xdist,$(FAST_WORKERS)) $(PYTEST_FLAGS) --durations=10 $(FAST_TESTS) || rc=$$?; \
	$(PY) -m pytest $(call xdist,$(TEST_WORKERS)) $(PYTEST_FLAGS) --durations=25 $(REST_TESTS) || rc=$$?; \
	exit $$rc

test-fast: setup
	$(PY) -m pytest $(call xdist,$(FAST_WORKERS)) $(PYTEST_FLAGS) --durations=10 $(FAST_TESTS)

bench: setup
	$(VENV)/bin/rayjobs bench --json results/bench.json

bench-quick: setup
	$(VENV)/bin/rayjobs bench --quick --json results/bench-quick.json

lint: setup
	$(VENV)/bin/ruff check rayjobs models tests benchmarks
	$(VENV)/bin/ruff format --check rayjobs models tests benchmarks

format: setup
	$(VENV)/bin/ruff format rayjobs models tests benchmarks
	$(VENV)/bin/ruff check --fix rayjobs models tests benchmarks

clean:
	rm -rf $(VENV) results .pytest_cache
