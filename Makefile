# The README's commands. Each target creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= config/tidepool.toml

.PHONY: run test lint bench clean

$(BIN)/tidepool: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.dev: $(BIN)/tidepool
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

run: $(BIN)/tidepool
	$(BIN)/tidepool run --config $(CONFIG)

test: $(VENV)/.dev
	@# the dashboard test drives Debian's chromium (never `playwright install`)
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 --dist loadfile

bench: $(VENV)/.dev
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
