# normexp: `make reproduce` runs the article's study, `make test` runs the test suite.
# Both set everything up on a fresh machine (a virtualenv in .venv, torch first).
#
#   make install               CPU torch $(TORCH_VERSION), then normexp (what `make reproduce` needs)
#   make install TORCH=cuda    torch's default (CUDA) build from the package index instead
#   make install-dev           install, plus the test tools, the Dask extra and MkDocs (`make test`, CI)
#   make docs                  install, plus MkDocs (the docs extra); build the site into site/, strictly
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NORMEXP := $(VENV)/bin/normexp
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
DOCS_STAMP := $(VENV)/.installed-docs
TORCH ?= cpu
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# never hang on an unreachable index: short socket timeouts, few retries. No byte-compiling of every
# file installed (half the install's time, mostly torch's modules that normexp never imports): see WARM.
PIP := $(PY) -m pip install -q --no-compile --timeout 30 --retries 2
# Byte-compile what normexp runs by importing it once (every normexp module, so torch, pandas, rich,
# matplotlib's Agg backend), with bytecode writing on even where PYTHONDONTWRITEBYTECODE is set.
WARM := env -u PYTHONDONTWRITEBYTECODE $(PY) -c "import importlib, pkgutil, normexp; \
	[importlib.import_module(m.name) for m in pkgutil.walk_packages(normexp.__path__, 'normexp.') \
	if m.name != 'normexp.__main__']"

ifeq ($(filter $(TORCH),cpu cuda),)
$(error TORCH=$(TORCH): must be cpu (the default) or cuda)
endif

.PHONY: install install-dev torch test test-all reproduce lint bench studies docs clean

install: $(STAMP)

install-dev: $(DEV_STAMP)

# torch first, so that normexp's `torch>=2.4` finds it satisfied: an installed torch is kept; else the
# CPU build (torch==V+cpu, a local version no CUDA wheel carries) from the local wheels or the index,
# plus PyTorch's CPU index where it answers within 5 s. TORCH=cuda takes the index's default build.
# Then normexp, constrained to that exact torch so pip can neither upgrade nor replace it, and a check
# that the torch in place is the build asked for.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(MAKE) --no-print-directory torch
	$(PY) -W ignore::UserWarning -c "import sys, torch; cuda = torch.version.cuda; print('torch==' + torch.__version__); \
		sys.exit(0 if '$(TORCH)' == 'cuda' or cuda is None else \
		f'error: .venv has torch {torch.__version__}, a CUDA {cuda} build: make clean, then make install, or make install TORCH=cuda')" \
		> $(VENV)/torch-constraint.txt
	$(PIP) -c $(VENV)/torch-constraint.txt -e .
	$(WARM)
	touch $(STAMP)

torch:
ifeq ($(TORCH),cuda)
	$(PIP) torch==$(TORCH_VERSION)
else
	if $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" 2>/dev/null; \
	then $(PIP) --extra-index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)$(CPU_LABEL)"; \
	else $(PIP) "torch==$(TORCH_VERSION)$(CPU_LABEL)"; fi
endif

# Linux and Windows CPU wheels carry the `+cpu` label; macOS wheels are CPU builds without one.
CPU_LABEL := $(if $(filter Darwin,$(shell uname -s)),,+cpu)

# The test suite imports far more (torch.func, the compiler, Dask, hypothesis): compile it all, on every
# core. As under pip, a file that fails to compile (torch ships one in Python 3.12 syntax) is skipped.
# MkDocs comes too (the docs extra), so that `make docs` and tests/test_docs.py build the site.
$(DEV_STAMP): $(STAMP)
	$(PIP) -c $(VENV)/torch-constraint.txt -e ".[dev,dask,docs]"
	$(PY) -m compileall -q -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))") \
		> /dev/null 2>&1 || true
	touch $(DEV_STAMP)

test: install-dev
	$(PY) -m pytest -q

test-all: install-dev
	$(PY) -m pytest -q -m ""

reproduce: install
	$(NORMEXP) sweep configs/warmup.yaml --force

# `normexp studies`: every study in configs/studies (the FFN ones on the batched engine, the Transformer's on the fast one,
# a worker process per core), then runs/REPORT.md with computed verdicts; realtext_warmup (hours) only when named:
# `normexp studies realtext_warmup [--quick]`
studies: install
	$(NORMEXP) studies --out runs

lint: install-dev
	$(VENV)/bin/ruff check normexp tests benchmarks examples docs

# engines and executors side by side, the norm speed table at the article's (64, 512, 4096), then issue 29's
# figures (the phase diagram's shape, auto vs reference, a large folder), whose last line sums them up; each
# benchmark names the CPU (model, family and model, ISA, torch's BLAS) it measured on
bench: install-dev
	$(PY) benchmarks/bench_sweep.py
	$(PY) benchmarks/bench_engines.py
	$(PY) benchmarks/bench_workers.py
	$(PY) benchmarks/bench_fast.py
	$(PY) benchmarks/bench_kernels.py
	$(PY) -c "from normexp.environment import cpu_summary; print('CPU:', cpu_summary())"
	$(PY) -m normexp norms bench --repeats 3
	$(PY) benchmarks/bench_scale.py

# the documentation site (mkdocs.yml): a broken link, a missing anchor or a page left out of the nav fails.
# It needs MkDocs only: the docs extra, not the test tools and bridges of install-dev.
$(DOCS_STAMP): $(STAMP)
	$(PIP) -c $(VENV)/torch-constraint.txt -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) runs site .pytest_cache
