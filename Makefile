# The README's commands. Each target creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= config/tidepool.toml
# without Material's banner about its successor, printed at every build
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs

.PHONY: run test lint bench docs clean

$(BIN)/tidepool: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.dev: $(BIN)/tidepool
	$(BIN)/pip install --quiet -e ".[dev,docs]"
	touch $@

run: $(BIN)/tidepool
	$(BIN)/tidepool run --config $(CONFIG)

test: $(VENV)/.dev
	@# the dashboard test drives Debian's chromium (never `playwright install`)
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	$(BIN)/ruff check src tests bench docs
	$(BIN)/mypy
	@# the site as committed: a broken link fails here, a stale reference page in tests/unit/test_docs_reference.py
	$(MKDOCS) build --strict --quiet
	$(BIN)/python -m pytest -n 2 --dist loadfile

# The documentation site, into site/: the reference pages written from the code first, then a strict build
# (a broken link or anchor, a page left out of the nav, fails it).
docs: $(VENV)/.dev
	$(BIN)/python docs/gen_reference.py
	$(MKDOCS) build --strict --quiet

# the peers bench/peers.py runs (pgqueuer, dramatiq with redis), from the `bench` extra; they use the machine's
# PostgreSQL (127.0.0.1:5432) and Redis (127.0.0.1:6379) as running services, which run_all.py checks first
$(VENV)/.bench: $(VENV)/.dev
	$(BIN)/pip install --quiet -e ".[dev,docs,bench]"
	touch $@

bench: $(VENV)/.bench
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) var site .pytest_cache .mypy_cache .ruff_cache
