# Thin wrappers; the README explains each target.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch==2.13.0 from PyPI is the CUDA build on Linux; set TORCH to pick another wheel.
TORCH  ?= torch==2.13.0
# The lock: exact versions of every other dependency (pip constraints), the ones `make test` passed
# with. `make test-latest` tries the newest versions pyproject allows; `make lock` rewrites the lock.
LOCK   ?= constraints.txt
LATEST := .venv-latest
# nbgrader calls `alembic` from PATH when it creates the gradebook.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
ASSIGNMENTS := $(notdir $(wildcard solutions/[0-9]*))
# JupyterLab refuses to start as root (most GPU containers and cloud images) without --allow-root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: setup lab check test test-latest lock release doctor bench execute reference bundle board
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(if $(LOCK),-c $(LOCK)) $(TORCH) -e ".[lab,dev]"
	touch $@

lab: setup            ## open the course in JupyterLab
	$(VENV)/bin/jupyter lab notebooks/ $(ALLOW_ROOT)

check: setup          ## is the install working: which backends run here, then labkit's floor and attention engine tests
	$(PY) -m labkit doctor
	LABKIT_PROFILE=cpu OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:xdist tests/labkit/core tests/labkit/engine/test_attention.py

test: setup           ## unit tests, release consistency, autograde round trip, solution notebooks (cpu profile)
	LABKIT_LOCK=$(LOCK) LABKIT_PROFILE=cpu HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile --durations=25 tests/

test-latest:          ## the same tests on the newest versions pyproject allows, in $(LATEST) (not part of CI)
	rm -rf $(LATEST)
	$(MAKE) test VENV=$(LATEST) LOCK=

lock:                 ## rewrite the lock from $(LATEST) (run `make test-latest` first and read its result)
	$(MAKE) setup VENV=$(LATEST) LOCK=
	{ echo "# The lock: exact versions for pip -c (torch comes from TORCH in the Makefile). Written by"; \
	  echo "# \`make lock\` from $(LATEST) on Python $$($(LATEST)/bin/python -c 'import platform; print(platform.python_version())'); refresh: README, Reproducible installs."; \
	  $(LATEST)/bin/python -m pip freeze --all --exclude-editable | grep -Ev '^(pip|torch)=='; } > constraints.txt

release: setup        ## regenerate notebooks/ from solutions/
	for a in $(ASSIGNMENTS); do $(VENV)/bin/nbgrader generate_assignment $$a --force || exit 1; done

doctor: setup         ## which attention backends run here
	$(PY) -m labkit doctor

bench: setup          ## attention sweep to build/bench/
	$(PY) -m labkit bench --out build/bench

execute: setup        ## run every solution notebook on this device: build/execute/ (copies, summary.md); GPU_MEMORY_GB=8 as on an 8 GB card
	HF_HUB_OFFLINE=1 $(if $(GPU_MEMORY_GB),LABKIT_GPU_MEMORY_GB=$(GPU_MEMORY_GB)) $(PY) -m labkit execute --out build/execute

reference: execute    ## on a GPU machine: store the GPU-only cells' outputs, shown to readers without a GPU
	$(PY) -m labkit reference --from build/execute

bundle: setup         ## student zip without solutions or hidden tests: build/student-bundle.zip
	$(PY) -m labkit bundle --out build/student-bundle.zip

board: setup          ## on a GPU: rank the students' kernels, e.g. make board ASSIGNMENT=08_decode_attention SUBMITTED=submitted
	HF_HUB_OFFLINE=1 $(PY) -m labkit board $(ASSIGNMENT) --submitted $(or $(SUBMITTED),submitted) --out build/board/$(ASSIGNMENT)
