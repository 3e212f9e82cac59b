# Two entry points, both self-installing: `make run` and `make test` (and `make docs`, the site).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test bench docs clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

## run: local split training, stage1 and stage0 as two processes over loopback.
## Two paper-sized iterations (a few minutes on a CPU); override with ARGS=...
RUN_ARGS ?= --total-steps 8192
run: $(STAMP)
	$(BIN)/splitrl run $(RUN_ARGS) $(ARGS)

## test: the test suite (what CI runs), on three workers (pytest-xdist) for two cores: a worker often waits
## (on a stage it spawned, a timeout a test checks), and a third fills the cores meanwhile; each worker's
## torch computes on one core's share (tests/conftest.py). A module runs on one worker (its module-scoped
## fixtures once); modules that make network namespaces take turns (tests/netem/support.py). TEST_WORKERS=0
## runs it in one process. The slowest 25 tests are listed at the end (where CI's minutes go).
TEST_WORKERS ?= 3
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations 25 $(ARGS)

## bench: the transport micro-benchmark
bench: $(STAMP)
	$(BIN)/splitrl bench transport $(ARGS)

## docs: the documentation site (mkdocs-material, mkdocs.yml), built strictly into site/; the CLI reference
## is generated from the commands (docs/hooks/reference.py). `$(BIN)/mkdocs serve` shows it while you edit.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) *.egg-info site
