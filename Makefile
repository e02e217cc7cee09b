# maxtext_posttrain developer and CI entry points.
#
#   make test      create/update the CPU venv from requirements/cpu.txt, then run pytest
#   make demo      run python -m maxtext_posttrain.demo
#   make bench     run python -m benchmarks.sft_vs_pretrain
#   make lint      pyink --check (2-space indentation, 122 columns, MaxText's style)
#   make format    pyink in place
#   make lock      re-resolve requirements/cpu.in into the pinned requirements/cpu.txt
#   make tpu-env   install MaxText's own [tpu] extra on top (TPU VMs only)
#   make peers-env build .venv-peers (a copy of the venv plus Tunix 0.1.7, requirements/peers.txt) for benchmarks.peers
#   make clean     remove build outputs (not the venv); `make distclean` removes the venv too
#
# Variables: VENV (default .venv), PYTHON (a Python 3.12 interpreter; found automatically), PYTEST_ARGS.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test
.DELETE_ON_ERROR:

VENV ?= .venv
MAXTEXT_PIN := maxtext==0.2.5
PYTEST_ARGS ?=
LINT_PATHS ?= setup.py maxtext_posttrain tests benchmarks scripts
PYINK_FLAGS := --pyink-indentation=2 --line-length=122

# A Python 3.12 interpreter (MaxText 0.2.5 needs >= 3.12; the lock is resolved on 3.12): `python3.12` on PATH if it
# really runs (a pyenv shim may exist but refuse to), else pyenv's installed 3.12.x versions. Override with `make PYTHON=...`
PYENV_ROOT_DIR := $(or $(PYENV_ROOT),$(shell pyenv root 2>/dev/null),$(HOME)/.pyenv)
PYTHON = $(firstword $(foreach c,python3.12 $(sort $(wildcard $(PYENV_ROOT_DIR)/versions/3.12*/bin/python3.12)),\
  $(shell $(c) -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && echo $(c))))

VPY := $(VENV)/bin/python
VPIP := $(VPY) -m pip
# The machine's pip.conf lists local file:// indexes; pip warns once per package missing from them. Hide that noise.
PIP_NOISE := { grep -v "^WARNING: Location 'file://" || true; }

.PHONY: env test demo bench lint format lock tpu-env clean distclean check-python

check-python:
	@if [ -z "$(PYTHON)" ]; then \
	  echo "error: no Python 3.12 found (tried python3.12 on PATH and $(PYENV_ROOT_DIR)/versions/3.12*/bin/python3.12)." >&2; \
	  echo "       Install one (e.g. 'pyenv install 3.12') or pass PYTHON=/path/to/python3.12." >&2; \
	  exit 1; \
	fi
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "error: $(PYTHON) is Python %d.%d; MaxText 0.2.5 needs >= 3.12" % sys.version_info[:2])'

$(VPY):
	@$(MAKE) --no-print-directory check-python
	@echo ">> creating $(VENV) with $(PYTHON) ($$($(PYTHON) --version))"
	$(PYTHON) -m venv $(VENV)

# The stamp is re-made whenever the packaging files change. requirements/cpu.txt is the full pinned closure,
# maxtext==0.2.5 included (it declares no base dependencies, so --no-deps loses nothing), so it installs with
# --no-deps and no resolver run; `pip check` then proves the closure is consistent.
$(VENV)/.installed: $(VPY) setup.py pyproject.toml requirements/cpu.txt
	@echo ">> installing pinned CPU environment into $(VENV)"
	@$(VPY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "error: $(VENV) has Python %d.%d; remove it (make distclean) and retry" % sys.version_info[:2])'
	$(VPIP) install -q --progress-bar off --no-deps -r requirements/cpu.txt 2>&1 | $(PIP_NOISE)
	$(VPIP) install -q --no-deps --no-build-isolation -e . 2>&1 | $(PIP_NOISE)
	$(VPIP) check
	@touch $@

env: $(VENV)/.installed

# Two pytest-xdist workers, whole files each (module fixtures stay shared): most tests are compile- and
# dispatch-bound, so two processes use a 2-core machine better than one. TEST_WORKERS=0 runs the suite in this
# process. With workers, each worker's XLA:CPU runs a matmul on one thread (TEST_XLA_FLAGS; the tests' subprocesses
# keep the flag): Eigen's intra-op pool would start a thread per core in every worker, and two workers' pools contend
# for the cores (the trainer, GRPO and PPO test files took 262 s instead of 316 s on 2 workers here).
TEST_WORKERS ?= 2
TEST_XLA_FLAGS ?= $(if $(filter 0 1,$(TEST_WORKERS)),,--xla_cpu_multi_thread_eigen=false)
test: $(VENV)/.installed
	env XLA_FLAGS="$(TEST_XLA_FLAGS)" JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests $(PYTEST_ARGS)

demo: $(VENV)/.installed
	$(VPY) -m maxtext_posttrain.demo

bench: $(VENV)/.installed
	$(VPY) -m benchmarks.sft_vs_pretrain

lint: $(VENV)/.installed
	$(VENV)/bin/pyink $(PYINK_FLAGS) --check --diff $(wildcard $(LINT_PATHS))

format: $(VENV)/.installed
	$(VENV)/bin/pyink $(PYINK_FLAGS) $(wildcard $(LINT_PATHS))

tpu-env: $(VENV)/.installed
	$(VPIP) install -e '.[tpu]' 2>&1 | $(PIP_NOISE)

# A peer library beside the project, for `python -m benchmarks.peers` only: a copy of the pinned venv (so our side runs
# on exactly the project's packages) plus requirements/peers.txt with --no-deps (see its header), then an import check
# of the Tunix modules the benchmark drives. Run it as `$(PEERS_VENV)/bin/python -m benchmarks.peers`.
PEERS_VENV ?= .venv-peers
.PHONY: peers-env
peers-env: $(PEERS_VENV)/.installed

$(PEERS_VENV)/.installed: $(VENV)/.installed requirements/peers.txt
	rm -rf $(PEERS_VENV)
	cp -a $(VENV) $(PEERS_VENV)
	rm -f $(PEERS_VENV)/.installed
	$(PEERS_VENV)/bin/python -m pip install -q --progress-bar off --no-deps -r requirements/peers.txt 2>&1 | $(PIP_NOISE)
	$(PEERS_VENV)/bin/python -c 'import tunix.generate.sampler, tunix.models.llama3.model, tunix.rl.grpo.grpo_learner'
	@touch $@

# Re-resolve the lock in a throwaway venv: newest releases of requirements/cpu.in on Python 3.12.
LOCK_VENV ?= /tmp/maxtext_posttrain-lock-venv
lock: check-python
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install --no-deps $(MAXTEXT_PIN) 2>&1 | $(PIP_NOISE)
	$(LOCK_VENV)/bin/pip install -r requirements/cpu.in setuptools wheel 2>&1 | $(PIP_NOISE)
	$(LOCK_VENV)/bin/pip check
	{ echo "# Pinned closure of requirements/cpu.in on Python $$($(LOCK_VENV)/bin/python -c 'import platform; print(platform.python_version())'), Linux x86_64, CPU."; \
	  echo "# Generated by 'make lock'; do not edit by hand. Install: pip install --no-deps -r requirements/cpu.txt"; \
	  $(LOCK_VENV)/bin/pip freeze --all --exclude pip | LC_ALL=C sort -f; } > requirements/cpu.txt
	rm -rf $(LOCK_VENV)
	@echo ">> wrote requirements/cpu.txt ($$(grep -c '==' requirements/cpu.txt) pins)"

clean:
	rm -rf build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
