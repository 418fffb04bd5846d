# normexp: `make reproduce` runs the article's study, `make test` runs the test suite.
# Both set everything up on a fresh machine (a virtualenv in .venv, torch first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NORMEXP := $(VENV)/bin/normexp
STAMP := $(VENV)/.installed

.PHONY: install test test-all reproduce lint bench studies clean

install: $(STAMP)

# torch first: the CPU build 2.13.0 where a local wheel provides it (no 6 GB CUDA download),
# any torch>=2.4 elsewhere; an already-installed torch is kept.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-index torch==2.13.0 \
		|| $(PY) -m pip install -q "torch>=2.4"
	$(PY) -m pip install -q -e ".[dev,dask]"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

test-all: install
	$(PY) -m pytest -q -m ""

reproduce: install
	$(NORMEXP) sweep configs/warmup.yaml --force

# every study in configs/studies (batched engine), then runs/REPORT.md with computed verdicts
studies: install
	$(PY) -m normexp.studies --out runs

lint: install
	$(VENV)/bin/ruff check normexp tests benchmarks examples

bench: install
	$(PY) benchmarks/bench_engines.py
	$(PY) benchmarks/bench_workers.py
	$(PY) benchmarks/bench_fast.py

clean:
	rm -rf $(VENV) runs .pytest_cache
