# Two entry points: `make train` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test lint bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/trainrun train $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

# The site in site/; strict: a broken link, a missing docstring target or any warning fails it.
$(VENV)/.installed-docs: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $@

docs: $(VENV)/.installed-docs
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs
