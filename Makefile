# Every target creates its own virtual environment on first use (torch pinned to the CPU build).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-gpu lint fmt pytest clean

# Bytecode is compiled as modules are first imported, not at install (--no-compile): the suite
# imports a fraction of torch and transformers, and compiling all of them was half the set-up's
# time. So bytecode must be written: PYTHONDONTWRITEBYTECODE (set on some machines) would make
# every process compile torch again.
unexport PYTHONDONTWRITEBYTECODE

WARM := $(VENV)/.warm

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile torch==2.13.0 -e '.[dev]'
	touch $(STAMP)

# what every rank and test imports, compiled once before the suite (not by both workers and
# their forkservers at once): read back even where a shell outside make sets
# PYTHONDONTWRITEBYTECODE
$(WARM): $(STAMP)
	$(PY) -c 'import torch.distributed.tensor, torch.distributed.checkpoint, torch._dynamo, transformers, fullshard.app.train.trainer, fullshard.app.cli, pytest, xdist'
	touch $(WARM)

# .[dev] includes the cli extra: the progress bar (tqdm) and loss.png (matplotlib)
demo: $(STAMP)
	$(VENV)/bin/fullshard train

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts benchmarks
	$(VENV)/bin/ruff format --check src tests scripts benchmarks
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff format src tests scripts benchmarks
	$(VENV)/bin/ruff check --fix src tests scripts benchmarks

# two workers (pytest-xdist), one per core, a test file to one worker: its tests share a launched
# run or a module's cached results, made once per worker (xdist_group marks do not group under
# pytest 9.2 with xdist 3.8, measured: a marked file's tests went to both workers)
pytest: $(WARM)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# lint beside the warm-up and the suite, not before them: mypy and the warm-up import are one
# core each, and the suite's two workers leave gaps (a launch waiting on a timeout); either
# failing fails the target
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 lint pytest

# the single-process layer alone (tests/fast, seconds)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m 'fast and not e2e' tests

# the GPU checks (tests/gpu: every CLI command on NCCL, every strategy in spawned ranks, the CUDA
# sanitizer), one test per check, on a machine with a GPU (skipped without one); a few minutes
test-gpu: $(WARM)
	$(PY) -m pytest -q -p no:xdist tests/gpu

clean:
	rm -rf $(VENV) runs
