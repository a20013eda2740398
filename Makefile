# Two entry points (see README): `make run` and `make test`. Both set up .venv first.
# jax >= 0.11 needs Python >= 3.12: use pyenv's 3.12 when present, else python3.12 on PATH.
PYTHON312 ?= $(shell PYENV_VERSION=3.12.1 pyenv which python3 2>/dev/null || command -v python3.12 2>/dev/null)
VENV := .venv
PROMPT ?= The king said
PYTEST_ARGS ?=

.PHONY: run test lint setup clean
run: setup
	$(VENV)/bin/mrv2-jax generate --prompt "$(PROMPT)"

# One pytest run on two workers. The speculative-decoding tests are handed out first, so that they
# run in fresh worker processes (tests/conftest.py, SPEC_FIRST): XLA:CPU (jax 0.11.2) aborted compiling
# their steps in workers that had run much of the suite before, never in fresh ones. The 25 slowest
# tests are listed at the end (issue 23: the suite time).
PYTEST := $(VENV)/bin/python -m pytest -q -n 2 --timeout 900 --durations=25

test: setup
	$(PYTEST) $(PYTEST_ARGS)

# ruff (lint + import order) and import-linter (layers point down: pyproject.toml's contract).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@if [ -z "$(PYTHON312)" ]; then echo "error: Python 3.12 not found (jax >= 0.11 needs it); install it, e.g. 'pyenv install 3.12.1'" >&2; exit 1; fi
	$(PYTHON312) -m venv $(VENV)
# uv installs the packages: it downloads them in parallel and does not byte-compile them (Python
# compiles each module at its first import, so only what the engine and the tests import).
	$(VENV)/bin/python -m pip install -q uv==0.13.8
	$(VENV)/bin/uv pip install -q --python $(VENV)/bin/python -e ".[test,server,notebook]"
	touch $@

clean:
	rm -rf $(VENV)
