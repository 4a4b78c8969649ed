# Two entry points: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# The CPU wheel of torch lies on the CI disk; naming the version stops pip from fetching a CUDA build.
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.8.0
HF_SPEC ?= transformers==5.17.0

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# --no-compile: no bytecode for every file of torch at install (77 -> 33 s on CI's 2 cores,
	# 2026-11-26); Python writes it for the modules the tests import, on first import.
	$(VPY) -m pip install -q --no-compile "$(TORCH_SPEC)" "$(TRITON_SPEC)" "$(HF_SPEC)" numpy pytest pytest-xdist
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

venv: $(VENV)/.installed

# One pytest worker per core (pytest-xdist): the CPU suite runs Triton's interpreter, single-threaded
# per test; on CI's 2 cores this halves the run (755 -> 342 s of pytest, 2026-11-22).
# PYTHONDONTWRITEBYTECODE= : where the environment sets it (this one does), every process compiled
# the source of torch and transformers again on import: 12-16 s of each worker and of each test's
# subprocess (cProfile, 2026-11-27). worksteal: an idle worker takes queued tests from a busy one,
# so the slow model tests at the end do not leave one core idle. no:logging: pytest's log capture
# also attaches to torch's structured-trace logger, which then formats every Dynamo compile event
# (5% of a model test). OMP_NUM_THREADS=1: two workers with two intra-op threads each on two cores
# spent 9% more time (kernel and rotary tests, 2026-11-27).
test: $(VENV)/.installed
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(VPY) -m pytest -q -n auto --dist worksteal -p no:logging -m "not gpu" tests

test-gpu:
	PYTHONPATH=src python3 -m pytest -q -m gpu tests

demo: $(VENV)/.installed
	$(VPY) -m transfuse demo

bench:
	PYTHONPATH=src python3 -m transfuse.bench

.PHONY: venv test test-gpu demo bench
