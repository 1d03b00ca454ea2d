# Every target creates its own virtual environment on first use (torch pinned to the CPU build).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint fmt pytest clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fullshard train

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff format src tests scripts
	$(VENV)/bin/ruff check --fix src tests scripts

# two workers (pytest-xdist), one per core; tests sharing a launched run stay on one worker
# (tests/conftest.py)
pytest: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

test: lint pytest

# the single-process layer alone (tests/fast, seconds)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m 'fast and not e2e' tests

clean:
	rm -rf $(VENV) runs
