# Two entry points: `make train` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

TRAIN_STAMP := $(VENV)/.installed-train

.PHONY: train test test-fast lint typecheck bench docs lock clean

# What a training run needs and nothing more (requirements-train.lock: trainrun's own
# dependencies, no extras, at the versions of requirements.lock), then trainrun from this
# checkout: the lean core `pip install trainrun` gives, hashes checked.
$(TRAIN_STAMP): pyproject.toml requirements-train.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements-train.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(TRAIN_STAMP)

# The exact tested set with every extra (requirements.lock, hashes checked), torch for the
# benchmarks (requirements-bench.lock), then trainrun from this checkout, resolving nothing anew.
$(STAMP): pyproject.toml requirements.lock requirements-bench.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --require-hashes -r requirements.lock
	$(BIN)/python -m pip install --quiet -r requirements-bench.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m pip check
	touch $(STAMP)

train: $(TRAIN_STAMP)
	$(BIN)/trainrun train $(ARGS)

# One pytest worker per core (pytest-xdist), four at most: most tests wait on a compile or a
# subprocess, so two workers on a 2-core machine took the suite from 862 s to 583 s. worksteal:
# a worker that runs dry takes tests queued behind a long one (the storage outage tests wait).
TEST_WORKERS ?= -n auto --maxprocesses 4 --dist worksteal
test: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/mypy
	$(BIN)/pyright
	$(BIN)/python -m pytest -q $(TEST_WORKERS) $(PYTEST_ARGS)

# The inner loop (under 2 minutes on 2 cores): every test but those marked slow (over about
# 3 s each there); CI runs them all.
test-fast: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/python -m pytest -q $(TEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks

# mypy and pyright over src/trainrun at the strictness [tool.mypy] and [tool.pyright] in
# pyproject.toml state.
typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/pyright

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

# The site in site/; strict: a broken link, a missing docstring target or any warning fails it.
$(VENV)/.installed-docs: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $@

docs: $(VENV)/.installed-docs
	$(BIN)/mkdocs build --strict

# requirements.lock from pyproject.toml's ranges (all extras but bench, and the test tools) for
# CPython 3.11 on Linux x86_64, with pip-tools in a venv of its own, against PyPI alone. It keeps
# the pins the ranges still allow; make lock LOCK_ARGS=--upgrade takes the newest. Then
# requirements-train.lock, the core alone, constrained to the same versions. Then make test.
LOCK_EXTRAS := report datasets tensorboard wandb huggingface text records cloud test
lock:
	test -x build/lock/bin/pip-compile || ($(PYTHON) -m venv build/lock && \
	  build/lock/bin/python -m pip install --quiet pip-tools==7.6.2)
	CUSTOM_COMPILE_COMMAND="make lock" build/lock/bin/pip-compile --quiet --generate-hashes \
	  --allow-unsafe --strip-extras --no-emit-find-links --no-emit-index-url \
	  --pip-args=--isolated $(LOCK_EXTRAS:%=--extra %) $(LOCK_ARGS) \
	  --output-file requirements.lock pyproject.toml
	CUSTOM_COMPILE_COMMAND="make lock" build/lock/bin/pip-compile --quiet --generate-hashes \
	  --allow-unsafe --strip-extras --no-emit-find-links --no-emit-index-url \
	  --pip-args=--isolated --constraint requirements.lock \
	  --output-file requirements-train.lock pyproject.toml

clean:
	rm -rf $(VENV) runs
